"""bench/edge_failover.py end to end, small (its smoke run: it needs no test host, only the
deploy's rendered Caddyfiles, real Caddy processes and the vLLM stand-in on this machine's
loopback): each case's requests all answered, by both donors."""

from __future__ import annotations

import re
import subprocess
import sys

from donorkit.inventory.paths import REPO_ROOT


def test_edge_failover_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "bench.edge_failover", "--count", "30",
                             "--seconds", "4"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)
    for case in ("model", "box", "rollout"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"{case}:"))
        assert re.search(r": 30 requests, \d+ answered by A, \d+ by B, 0 failed", line), line
