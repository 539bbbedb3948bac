"""Converge: what the fleet's first deploy did (the package fixture's record: a refused edge, an
interrupted first run, the full run, a second box from the wheel cache); the boxes that must not
converge each stop at their step with one clear line and nothing installed after it; a batch of
boxes of one stack deployed together; the weights fetched again after a cut download. Leaves the
fleet converged."""

from __future__ import annotations

import hashlib
import re
import shutil

from donorkit.inventory.paths import REPO_ROOT
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.converged import Record
from tests.testbed.fleet.helpers import (
    BAD,
    EDGE,
    GOOD,
    OLD,
    OLD_DRIVER,
    SECOND,
    TIMES,
    changed_ops,
    deploy,
    failed_ops,
    hub,
    preview_rows,
    pyinfra_as_a_user_runs_it,
    unit_start,
)

HUB_FOLDER = "/home/fox/.cache/huggingface/hub/models--turboderp--Qwen3.8-27B-exl3"
MANIFESTS = "/home/fox/.cache/uncloseai/weights"
SHARD = "model-00001-of-00002.safetensors"


def test_edge_with_a_rate_limit_is_refused_before_its_config(record: Record) -> None:
    """The distro's Caddy has no caddy-ratelimit: with a limit set, the edge is refused after
    installing Caddy and before any of its config is written, with a message saying how to get
    such a Caddy. (The testbed's donors file has `rate_limit: null`; this run used a copy with
    the seed's limit, through the fleet inventory's DONORS_FILE, before the edge's first
    deploy.)"""
    edge = record.edge_after_refusal
    assert "events: 3" in edge["limited_file"]
    result = record.rate_limited
    assert result is not None
    output = result.stdout
    assert result.returncode != 0, output[-4000:]
    assert (f"refused: {EDGE}: the inventory's rate_limit for this edge needs the Caddy module "
            "http.handlers.rate_limit") in output, output[-4000:]
    assert "xcaddy build --with github.com/mholt/caddy-ratelimit" in output
    assert "caddy add-package github.com/mholt/caddy-ratelimit" in output
    assert edge["caddy"] == 0  # installed, then refused
    assert "Managed by the uncloseai" not in edge["caddyfile"]
    assert edge["tls"] != 0


def test_interrupted_first_run_then_full_run_converges(record: Record) -> None:
    """The deploy killed while tb-4090's venv was being installed; the next run converged it
    (tb-3090's apt locks held by another process for the run's first 30 s)."""
    assert record.interrupted_in_venv_step, \
        "the deploy ended before its venv step could be interrupted"
    assert record.first is not None
    rc, report, log, _ = record.first
    assert report, f"pyinfra printed no JSON (rc {rc}):\n{log[-6000:]}"
    assert failed_ops(report, GOOD) == [], log[-4000:]
    assert sorted(report["results"]["failed_hosts"]) == sorted([BAD, OLD]), log[-4000:]
    assert rc != 0  # two hosts failed
    busy = re.search(r"apt_get_when_free: apt is busy \((/var/lib/\S+) held by pid \d+", log)
    free = re.search(r"apt_get_when_free: apt's locks are free after (\d+) s", log)
    assert busy and free, "tb-3090's apt step did not say it waited for the locks"
    TIMES["apt lock wait seen"] = float(free[1])
    print(f"\ntb-3090 waited {free[1]} s for apt's locks ({busy[1]} was held)")
    assert int(free[1]) >= 5
    # ... and then ran its apt steps to the end: it stops at the CUDA step, as always.
    assert f"refused: {BAD}: /usr/local/cuda-12.8/bin/nvcc is missing" in log, log[-4000:]


def test_old_driver_stops_at_the_preflight_before_installing(hosts: dict[str, Host]) -> None:
    """Its stand-in nvidia-smi reports an R570 driver: refused by name, minimum and profile,
    before any package is installed (the fleet's first converge ran it beside the others)."""
    rc, report, output, _ = deploy("--limit", OLD, want_json=False)
    assert rc != 0
    refusal = (f"refused: {OLD}: NVIDIA driver {OLD_DRIVER} is older than 580.65.06, the "
               "minimum for CUDA 13.3 (card profile 'rtx4090')")
    assert refusal in output, output[-4000:]
    assert "Starting operation: CUDA toolkit | " not in output[output.index(refusal):]
    # The preview (`--dry`, as the README gives it): the refusal as a refusal, not a "Change",
    # and no change proposed after it on that host (pyinfra's own server.shell for the plugin's
    # reinstall stays under "Conditional Change": its condition is an earlier step's change).
    rc, preview = pyinfra_as_a_user_runs_it("inventory/testbed.py", "deploy.py", "--limit", OLD,
                                            "--dry")
    assert rc == 0, preview[-6000:]
    said = [line for line in preview.splitlines() if refusal in line]
    assert said and said[0].rstrip().endswith(
        "(preview: this host stops at this step when the run executes)"), preview[-6000:]
    assert preview_rows(preview, OLD, "change") == [], preview[-6000:]
    nothing = ssh(hosts[OLD], "test ! -e /usr/share/keyrings/cuda-archive-keyring.gpg && "
                              "test ! -e /etc/apt/sources.list.d/cuda-debian12-x86_64.list && "
                              "! dpkg -s ninja-build >/dev/null 2>&1", check=False)
    assert nothing.returncode == 0, "something was installed on the box with the old driver"


def test_broken_host_stops_at_the_cuda_step_with_a_clear_message(hosts: dict[str, Host]) -> None:
    rc, report, output, _ = deploy("--limit", BAD, want_json=False)
    assert rc != 0
    # pyinfra pads host names to the longest one's width: match the message itself.
    refusal = (f"refused: {BAD}: /usr/local/cuda-12.8/bin/nvcc is missing after "
               "installing cuda-toolkit-12-8")
    assert refusal in output, output[-4000:]
    after = output[output.index(refusal):]
    assert "Starting operation: Build tools | " not in after, "it went on after the refusal"
    # Nothing after that step ran on it: no venv.
    assert ssh(hosts[BAD], "test -e /opt/uncloseai/vllm-venv", check=False).returncode != 0


def test_second_box_of_a_stack_gets_the_cached_wheel(record: Record) -> None:
    """tb-4090 built exllamav3 and copied the wheel back; tb-4090b (same stack) installed that
    wheel: no clone, no compiler. Before that, `--dry` on the bare box proposed the whole build
    (the steps that depend on earlier ones included) and changed nothing. Its dpkg was killed
    mid-install before its first deploy, which finished dpkg's work first."""
    wheels = record.second_wheels_before
    assert len(wheels) == 1, wheels
    rc, output = record.second_dry
    assert rc == 0, output[-6000:]
    proposed = preview_rows(output, SECOND)
    for step in ("Install build tools", "Create the venv /opt/uncloseai/vllm-venv",
                 "Install the vllm-exl3 plugin again (its source changed)"):
        assert step in proposed, (step, proposed)
    # exllamav3's steps key the wheel by the venv's torch and the toolkit's nvcc, which a bare
    # box gets from the steps before them: the preview says so and goes on (it checks again
    # when the run executes).
    assert f"refused for now: {SECOND}: cannot key the exllamav3 wheel" in output, output[-6000:]
    assert f"refused: {SECOND}" not in output, output[-6000:]
    assert any(step.startswith("Install Caddy's files (") for step in proposed), proposed
    assert record.second_bare != 0
    # dpkg killed at the worst moment (killed a second later instead, as this test once did,
    # the state depended on timing; CI once hit this one).
    assert record.dpkg_killed.strip() == "killed", \
        f"no package mid-unpack to kill: {record.dpkg_killed}"
    audit = record.dpkg_audit_killed
    assert "must be reinstalled" in audit, f"dpkg was killed but nothing needs a reinstall: {audit}"
    assert record.second is not None
    rc, report, log, _ = record.second
    assert report, f"pyinfra printed no JSON (rc {rc}):\n{log[-6000:]}"
    assert rc == 0, log[-4000:]
    assert "apt_get_when_free: dpkg was interrupted: running dpkg --configure -a first" in log
    assert "apt_get_when_free: reinstalling what dpkg left half-installed:" in log
    after = record.second_after
    assert after["audit"].strip() == ""
    assert "building v1.5.1" not in log and "exllamav3: building" not in log, log[-4000:]
    assert after["clone"] != 0
    assert "exllamav3_ext" in after["imported"]
    # The engine's kernels: tb-4090's first start built them (the stand-in's compile) and the
    # deploy copied them back; tb-4090b got them before its unit started (FlashInfer's folder of
    # precompiled kernels in the venv, vLLM's compile cache in the home), so its first start
    # built nothing.
    kernels = after["kernels"]
    assert len(kernels) == 1, kernels
    assert "vllm-standin: kernels built in 5 s" in after["good_journal"]
    started = after["second_journal"]
    assert "vllm-standin: kernels found (/opt/uncloseai/vllm-venv/lib/python3" in started, \
        started[-2000:]
    assert "flashinfer/data/aot/standin_attention_" in started and "kernels built" not in started
    assert after["compile_cache_owner"].strip() == "fox"
    # Each entry names the box it came from, a cache builder (written by the operator's
    # machine, not by the box).
    assert (wheels[0].parent / "built-by").read_text() == f"{GOOD}\n"
    assert (kernels[0].parent / "built-by").read_text() == f"{GOOD}\n"


def test_a_batch_of_boxes_of_one_stack_in_one_run(hosts: dict[str, Host]) -> None:
    """Boxes of one stack that all lack the wheel, deployed together, the way an operator adds
    a batch of donors. With the cache empty and the exllamav3 state of tb-4090 and tb-4090b
    wiped (stamp, the box's wheels, the clone), one run deploys both: each builds and copies
    back under its own temporary names; both converge; the cache holds one whole entry (one
    box's wheel, its sidecar matching), no temporary file, and the log no traceback. (They
    shared one temporary name before: `bench/noop_rerun.py --hosts 4` ended with tracebacks and
    `No hosts remaining!`.)"""
    cache = REPO_ROOT / ".testbed/wheel-cache"
    shutil.rmtree(cache)
    batch = [GOOD, SECOND]
    for name in batch:
        ssh(hosts[name], "rm -rf /opt/uncloseai/state/exllamav3.stack /opt/uncloseai/wheels "
                         "/opt/uncloseai/src/exllamav3")
    rc, report, log, took = deploy("--limit", GOOD, "--limit", SECOND)
    TIMES["batch of 2, both building"] = took
    assert rc == 0, log[-6000:]
    for name in batch:
        assert "exllamav3: build v1.5.1 for arch 8.9 (no cached wheel)" in changed_ops(
            report, name), (name, changed_ops(report, name))
        assert "exllamav3: copy the wheel built here back to the cache" in changed_ops(
            report, name)
    assert "Traceback" not in log and "Unexpected error in Python callback" not in log, log
    entries = [p for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]
    wheels = [p for p in entries if p.suffix == ".whl"]
    assert len(wheels) == 1 and not [p for p in entries if p.name.endswith(".download")], entries
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    assert (wheels[0].parent / f"{wheels[0].name}.sha256").read_text().split()[0] == digest
    built = {name: ssh(hosts[name], f"sha256sum /opt/uncloseai/wheels/*/{wheels[0].name}"
                       ).stdout.split()[0] for name in batch}
    assert digest in built.values(), (digest, built)  # one box's wheel, whole
    # ... and the entry names that box (both are cache builders).
    assert built[(wheels[0].parent / "built-by").read_text().strip()] == digest
    for name in batch:
        imported = ssh(hosts[name], "runuser -u fox -- /opt/uncloseai/vllm-venv/bin/python -c "
                                    "'import torch, exllamav3_ext; print(exllamav3_ext.__file__)'")
        assert "exllamav3_ext" in imported.stdout
    rc, report, log, _ = deploy("--limit", GOOD, "--limit", SECOND)
    assert rc == 0 and report["results"]["totals"]["success"] == 0, log[-4000:]


def test_weights_resume_after_a_cut_and_a_converged_run_fetches_nothing(
        hosts: dict[str, Host]) -> None:
    """tb-4090's weights removed and fetched again by the deploy, the stand-in hub cutting the
    first shard's download half way: the fetch resumes it (one ranged request), the unit keeps
    running (same revision); a converged run then fetches nothing."""
    good = hosts[GOOD]
    size = int(ssh(good, f"stat -L -c %s {HUB_FOLDER}/snapshots/*/{SHARD}").stdout)
    # Settle first: a restart left due by an earlier step is not this test's.
    rc, _, log, _ = deploy("--limit", GOOD)
    assert rc == 0, log[-4000:]
    before = unit_start(good, "vllm-qwen.service")
    ssh(good, f"rm -rf {HUB_FOLDER} {MANIFESTS}")
    hub("reset", {})
    hub("fault", {"file": SHARD, "cut_after": size // 2, "times": 1})
    rc, report, log, took = deploy("--limit", GOOD)
    TIMES["weights re-fetch with a cut"] = took
    assert rc == 0, log[-4000:]
    # The fetcher's progress and summary are in the run's output, as it ran.
    assert "weights: fetching turboderp/Qwen3.8-27B-exl3@" in log, log[-4000:]
    assert "weights: done, 7 files" in log, log[-4000:]
    gets = [r for r in hub("requests") if r["method"] == "GET" and "/_cdn/" in r["path"]
            and r["bytes"] and r["status"] in (200, 206)]
    cut = [r for r in gets if r["bytes"] == size // 2]
    assert len(cut) == 1, gets
    resumed = [r for r in gets if r["range"]]
    assert len(resumed) == 1 and resumed[0]["path"] == cut[0]["path"], gets
    assert resumed[0]["range"] == f"bytes={(size // 2) // (10 << 20) * (10 << 20)}-", resumed
    # New weights of the same revision: the unit keeps running.
    assert unit_start(good, "vllm-qwen.service") == before

    hub("reset", {})
    rc, report, log, _ = deploy("--limit", GOOD)
    assert rc == 0 and changed_ops(report, GOOD) == [], log[-4000:]
    assert hub("requests") == []
