"""`run_deploy()`: pyinfra run the way the operator runs it (the checkout's venv, the repo root,
the production inventory unless told), the one way tests and benchmarks run a deploy and read
its `--json` report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from donorkit.inventory.paths import REPO_ROOT

BIN = Path(sys.executable).parent


class Deployed(NamedTuple):
    rc: int
    report: dict  # pyinfra's --json results; {} without json or when it printed none
    log: str  # stdout then stderr (interleaved as printed with `lines`)
    elapsed: float  # seconds


def run_deploy(*args: str, inventory: str = "inventory/gpus.py", deploy: str = "deploy.py",
               donors: Path | str | None = None, json_report: bool = True, yes: bool = True,
               answer: str | None = None, env: dict[str, str] | None = None,
               cwd: Path = REPO_ROOT, timeout: float = 3000, prefix: list[str] | None = None,
               lines: list[tuple[float, str]] | None = None) -> Deployed:
    """`pyinfra [-y] [--json] ARGS INVENTORY DEPLOY` in `cwd`. `donors`: the fleet file
    (DONORS_FILE); `answer`: what the prompt reads (with yes=False, as the README runs it);
    `prefix`: a command put before pyinfra's (a profiler); `lines`: given a list, the output is
    streamed (stderr into stdout) and each line appended with its time since the start."""
    command = [*(prefix or []), str(BIN / "pyinfra"), *(["-y"] if yes else []),
               *(["--json"] if json_report else []), *args, inventory, deploy]
    env = {**os.environ, **(env or {}), **({"DONORS_FILE": str(donors)} if donors else {})}
    started = time.monotonic()
    if lines is None:
        result = subprocess.run(command, cwd=cwd, env=env, input=answer, capture_output=True,
                                text=True, timeout=timeout)
        rc, stdout, log = result.returncode, result.stdout, result.stdout + result.stderr
    else:
        with subprocess.Popen(command, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.monotonic() - started, line))
            rc = proc.wait(timeout)
        stdout = log = "".join(line for _, line in lines)
    elapsed = time.monotonic() - started
    start = stdout.find('{"plan"') if json_report else -1
    report = json.JSONDecoder().raw_decode(stdout, start)[0] if start >= 0 else {}
    return Deployed(rc, report, log, elapsed)


def operations(report: dict, host: str, outcome: str = "success") -> list[str]:
    """Operation names (without their step's "Deploy name | " prefix) with that outcome
    (success: changed, no_change, error) on host in a --json report."""
    return [op["name"].split(" | ", 1)[-1] for op in report["results"]["operations"]
            if host in op[outcome]]


def changes(report: dict) -> int:
    """How many operations changed something, all hosts."""
    return report["results"]["totals"]["success"]
