"""Every bench/ script has a smoke run, so none rots between its real runs (bench/noop_rerun.py
once failed for weeks on an edge the testbed's donors file had gained). Here, without test
hosts: each script starts and parses its arguments; each donors file a benchmark generates loads
through the real loader; load_cpu and latency_relay run for real. With test hosts
(`make testbed`): tests/testbed/fleet/test_idempotence.py runs noop_rerun's three deploys (ours,
stock with bench/stock_inventory.py, floor with bench/floor_deploy.py) on its converged host, and
tests/testbed/test_bench_smoke.py runs edge_failover end to end."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import latency_relay, load_cpu, noop_rerun
from bench import rollout as rollout_bench
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.paths import REPO_ROOT

CLIS = sorted(p.stem for p in (REPO_ROOT / "bench").glob("*.py")
              if "if __name__ == \"__main__\":" in p.read_text())


def test_every_bench_script_is_a_cli_or_a_piece_of_one() -> None:
    pieces = {"floor_deploy", "stock_inventory", "latency_relay"}  # used by noop_rerun
    scripts = {p.stem for p in (REPO_ROOT / "bench").glob("*.py")} - {"__init__"}
    assert scripts == set(CLIS) | pieces, scripts


@pytest.mark.parametrize("name", CLIS)
def test_the_script_starts(name: str) -> None:
    result = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_noop_rerun_donors_files_load(tmp_path: Path) -> None:
    names = [("tb-4090", "10.213.0.11"), ("tb-bench2", "10.213.0.22")]
    plain = noop_rerun.donors_file(names, tmp_path / "plain.yml")
    through = {n: (f"127.0.1.{i + 1}", 2200) for i, (n, _) in enumerate(names)}
    relayed = noop_rerun.donors_file(names, tmp_path / "relayed.yml", through)
    for path in (plain, relayed):
        donors, edges = load_inventory(path)
        assert sorted(donors) == ["tb-4090", "tb-bench2"] and edges == {}


def test_rollout_bench_donors_file_loads(tmp_path: Path) -> None:
    names = [("tb-4090", "10.213.0.11"), ("tb-bench2", "10.213.0.22")]
    donors, _ = load_inventory(rollout_bench.donors_file(names, 2.5, tmp_path / "d.yml"))
    assert {r.hostname for d in donors.values() for r in d.routes} == {
        rollout_bench.HOSTNAME}


def test_load_cpu_runs(tmp_path: Path) -> None:
    """The controller-only benchmark, for real: one round of this checkout."""
    result = subprocess.run([sys.executable, "-m", "bench.load_cpu", "--rounds", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "this checkout    controller CPU median" in result.stdout


def test_latency_relay_delays_each_way() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    with latency_relay.Relay({"echo": ("127.0.0.1", port)}, delay_s=0.05) as relay:
        with socket.create_connection((relay.addresses["echo"], relay.ports["echo"])) as conn:
            started = time.monotonic()
            conn.sendall(b"ping")
            assert conn.recv(1024) == b"ping"
            assert time.monotonic() - started >= 0.1  # 50 ms there, 50 ms back
    server.close()
    assert load_cpu.donors_file  # the module's own smoke is test_load_cpu_runs
