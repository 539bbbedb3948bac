"""Idempotence: on the converged fleet a second run changes and restarts nothing in two remote
commands, as do the no-op benchmark's three modes; the README's command and `--dry --diff`
preview without touching the box; the run's batched facts read what their own commands read;
drift (a stopped unit, an edited file, a removed package, a changed dependency) is repaired by
the next run. Leaves the fleet converged."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from donorkit.inventory.paths import REPO_ROOT
from pyinfra_declared.batched_facts import PathStates, UnitState
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.helpers import (
    DONORS,
    GOOD,
    TIMES,
    changed_ops,
    deploy,
    model_started,
    preview_rows,
    pyinfra_as_a_user_runs_it,
    unit_start,
)


def test_second_run_changes_nothing_and_restarts_nothing(hosts: dict[str, Host]) -> None:
    good = hosts[GOOD]
    before = unit_start(good, "vllm-qwen.service")
    caddy_before = unit_start(good, "caddy")
    rc, report, log, took = deploy("--limit", GOOD, "--debug")
    TIMES["no-op re-run"] = took
    assert rc == 0, log[-4000:]
    assert changed_ops(report, GOOD) == []
    assert report["results"]["totals"]["success"] == 0
    # Checked in full, in two remote commands: the host profile (read while the deploy loads)
    # and the snapshot of every operation's facts (pyinfra_declared/snapshot.py). More means
    # a fact read that no operation declared.
    commands = re.findall(r"Running command on \S+: \(pty=\w+\) (.{0,60})", log)
    assert len(commands) == 2, commands
    assert "@@pyinfra-snapshot" in commands[1]
    assert unit_start(good, "vllm-qwen.service") == before
    assert unit_start(good, "caddy") == caddy_before


def test_noop_benchmark_modes_run_on_the_converged_host(hosts: dict[str, Host]) -> None:
    """bench/noop_rerun.py's three deploys, as the benchmark runs them (its smoke run): ours,
    stock (bench/stock_inventory.py) and the floor (bench/floor_deploy.py), each a no-op."""
    from bench import noop_rerun

    for mode in ("ours", "stock", "floor"):
        elapsed, report, _, cpu = noop_rerun.deploy(DONORS, "--limit", GOOD, mode=mode)
        assert noop_rerun.changes(report) == 0, (mode, report)
        print(f"\nnoop bench smoke, {mode}: {elapsed:.2f} s (controller CPU "
              f"{cpu['controller']:.2f} s)")


def test_the_readme_command_previews_and_applies(hosts: dict[str, Host]) -> None:
    """`pyinfra inventory/testbed.py deploy.py` as the README gives it, on the converged host:
    change detection, the proposed changes, the prompt (answered), the run: nothing changes."""
    good = hosts[GOOD]
    before = unit_start(good, "vllm-qwen.service")
    rc, output = pyinfra_as_a_user_runs_it("inventory/testbed.py", "deploy.py", "--limit", GOOD,
                                           answer="\n")
    assert rc == 0, output[-6000:]
    assert "--> Detected changes:" in output and "Press enter to execute" in output
    run = output.split("--> Beginning operation run...", 1)[1].split("--> Results:", 1)[0]
    assert "No changes" in run and "Success" not in run
    # The one step that may run: the plugin's reinstall, if its source changes (pyinfra's
    # "Conditional Change" column); nothing else is proposed on a converged host.
    assert preview_rows(output, GOOD, "change") == [], output[-6000:]
    assert preview_rows(output, GOOD, "conditional") == [
        "Install the vllm-exl3 plugin again (its source changed)"], output[-6000:]
    assert unit_start(good, "vllm-qwen.service") == before


def test_dry_diff_previews_a_data_change_and_touches_nothing(hosts: dict[str, Host],
                                                             tmp_path: Path) -> None:
    """A new environment variable in the fleet data: `--dry --diff` names the unit's step and
    shows the new line; the box is left as it was."""
    good = hosts[GOOD]
    doc = yaml.safe_load(DONORS.read_text())
    defaults = yaml.safe_load((REPO_ROOT / "inventory/defaults.yml").read_text())
    doc["donors"][GOOD]["overrides"] = {"unit_environment": {
        **defaults["unit_environment"], "UNCLOSEAI_PREVIEW": "1"}}
    donors = tmp_path / "donors.yml"
    donors.write_text(yaml.safe_dump(doc))
    unit = "/etc/systemd/system/vllm-qwen.service"
    unit_before = ssh(good, f"sha256sum {unit}").stdout
    started = unit_start(good, "vllm-qwen.service")
    rc, output = pyinfra_as_a_user_runs_it("inventory/gpus.py", "deploy.py", "--limit", GOOD,
                                           "--dry", "--diff", env={"DONORS_FILE": str(donors)})
    assert rc == 0, output[-6000:]
    # A changed unit is another kernel stack (donorkit/box/kernel_cache.py): the box records it (no
    # box of it has kept kernels yet) and will copy back what its restart builds.
    assert preview_rows(output, GOOD, "change") == [
        "Install the readiness gate and vllm-qwen.service",
        "Kernels for vllm-qwen.service: from an earlier box of its stack",
        "Kernels for vllm-qwen.service: copy what its first start built back to the cache",
    ], output[-6000:]
    assert f"Will modify {unit}" in output
    assert re.search(r"\+\s*Environment=\"?UNCLOSEAI_PREVIEW=1", output), output[-6000:]
    assert "--> Beginning operation run" not in output
    assert ssh(good, f"sha256sum {unit}").stdout == unit_before
    assert unit_start(good, "vllm-qwen.service") == started


def test_batched_snapshot_reads_match_their_own_reads(hosts: dict[str, Host]) -> None:
    """On real systemd: the snapshot's one systemctl for all units and one stat for all paths
    (pyinfra_declared/snapshot.py) give each request what its own command gives."""
    good = hosts[GOOD]

    def remote(command: str) -> list[str]:
        return ssh(good, f"sh -c {shlex.quote(command)}").stdout.splitlines()

    units = [{"unit": "vllm-qwen.service",
              "record": "/opt/uncloseai/state/vllm-qwen.service.started",
              "depends_on": ["/etc/systemd/system/vllm-qwen.service"]},
             {"unit": "vllm-hermes.service", "present": "/etc/systemd/system/vllm-hermes.service"},
             {"unit": "caddy", "present": "/etc/caddy/Caddyfile"}]
    paths = [{"paths": ["/etc/caddy/Caddyfile", "/opt/uncloseai"],
              "digest": ["/etc/caddy/Caddyfile"]},
             {"paths": ["/etc/caddy/Caddyfile", "/opt/uncloseai/absent"]}]
    for fact, requests in ((UnitState(), units), (PathStates(), paths)):
        batched = fact.batch_process(remote(fact.batch_command(requests)), requests)
        assert batched == [fact.process(remote(fact.command(**kw))) for kw in requests]
    states = UnitState().batch_process(remote(UnitState().batch_command(units)), units)
    assert [s["ActiveState"] for s in states] == ["active", "inactive", "active"]
    assert [s["LoadState"] for s in states] == ["loaded", "not-found", "loaded"]
    assert len(states[0]["Recorded"]) == 64 and states[2]["Present"] == "yes"


def test_rerun_repairs_drift(hosts: dict[str, Host]) -> None:
    """A stopped unit, an edited Caddyfile and a removed package are each put right by a re-run;
    and a unit whose dependency changed while a run died is restarted by the next run. The
    last drift removed, a run settles the box (its restart due) and its model answers."""
    good = hosts[GOOD]
    # Each is checked through the run's one-command snapshot of the host
    # (pyinfra_declared/snapshot.py).
    ssh(good, "systemctl stop vllm-qwen.service; echo '# drift' >> /etc/caddy/Caddyfile; "
              "apt-get -q -y remove ninja-build >/dev/null; "
              "/opt/uncloseai/vllm-venv/bin/pip uninstall -q -y wheel; "
              "chmod 700 /opt/uncloseai/state; chmod 644 /opt/uncloseai/bin/build-exllamav3.sh; "
              "usermod --shell /bin/bash fox")
    # Previewed first: the repairs are proposed, the Caddyfile's stray line shown, nothing done.
    rc, output = pyinfra_as_a_user_runs_it("inventory/testbed.py", "deploy.py", "--limit", GOOD,
                                           "--dry", "--diff")
    assert rc == 0, output[-6000:]
    proposed = preview_rows(output, GOOD, "change")
    for step in ("Install build tools", "Create service user fox",
                 "Install the exllamav3 build script"):
        assert step in proposed, (step, proposed)
    assert any(step.startswith("Install Caddy's files (") for step in proposed), proposed
    assert re.search(r"-\s*# drift", output), output[-6000:]
    assert "# drift" in ssh(good, "cat /etc/caddy/Caddyfile").stdout
    rc, report, log, _ = deploy("--limit", GOOD)
    assert rc == 0, log[-4000:]
    changed = changed_ops(report, GOOD)
    assert "Install build tools" in changed
    assert any(name.startswith("Install Caddy's files (") for name in changed), changed
    assert "Run Caddy with the current config" in changed
    assert any(name.startswith("Run vllm-qwen.service") for name in changed)
    assert any(name.startswith("Install vllm ") for name in changed)
    assert any(name.startswith("Create /opt/uncloseai and") for name in changed)
    assert "Install the exllamav3 build script" in changed
    assert "Create service user fox" in changed
    assert ssh(good, "systemctl is-active vllm-qwen.service caddy").stdout.split() == [
        "active", "active"]
    assert "# drift" not in ssh(good, "cat /etc/caddy/Caddyfile").stdout
    assert ssh(good, "stat -c %a /opt/uncloseai/state /opt/uncloseai/bin/build-exllamav3.sh; "
                     "getent passwd fox | cut -d: -f7; "
                     "ls -d /opt/uncloseai/vllm-venv/lib/python3.11/site-packages/wheel-*"
               ).stdout.split() == ["755", "755", "/usr/sbin/nologin",
                                    "/opt/uncloseai/vllm-venv/lib/python3.11/site-packages/"
                                    "wheel-0.48.0.dist-info"]

    # A dependency changed on disk (as when a run dies between pip and the restart).
    before = unit_start(good, "vllm-qwen.service")
    drift = "/opt/uncloseai/vllm-venv/lib/python3.11/site-packages/drift-0.dist-info"
    ssh(good, f"mkdir {drift}")
    try:
        rc, report, log, _ = deploy("--limit", GOOD)
        assert rc == 0, log[-4000:]
        assert unit_start(good, "vllm-qwen.service") != before
    finally:
        ssh(good, f"rmdir {drift}")
        rc, _, log, _ = deploy("--limit", GOOD)  # its removal is a dependency change too
        model_started(good)
    assert rc == 0, log[-4000:]
