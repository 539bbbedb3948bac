"""bench/edge_failover.py end to end, small (its smoke run: it needs no test host, only the
deploy's rendered Caddyfiles, real Caddy processes and the vLLM stand-in on this machine's
loopback): in each case both donors answer. The planned case (rollout: drained first) loses no
request. The unplanned ones (a model stopped, a Caddy killed) may lose only what was already on
its way to B when it went (docs/benchmarks.md: 0 or 1 such per run, B's 502 passed on: the edge
never sends a request that reached a donor again, a POST must not run twice); a request sent
after B went is never lost."""

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
        found = re.search(r": 30 requests, [1-9]\d* answered by A, [1-9]\d* by B, (\d+) failed "
                          r"\[(.*?)\]", line)
        assert found, line
        if case == "rollout":
            assert found[1] == "0", line
            continue
        # (seconds after B went, status): in flight means sent before B had gone (its stop
        # takes a moment: B got requests up to 0.04 s after it, docs/benchmarks.md).
        lost = [float(at) for at in re.findall(r"\((-?[\d.]+), ", found[2])]
        assert len(lost) <= 1 and all(at < 0.1 for at in lost), line
