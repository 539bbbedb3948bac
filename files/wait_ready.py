"""The readiness gate: wait until a vLLM unit's loopback port lists its checkpoint.

Shipped to the box by the deploy and run there (as root: it reads the unit's journal) right after
the unit was (re)started, with the system python3 (stdlib only):

    wait_ready.py --unit vllm-qwen.service --port 18888 --model ORG/NAME --timeout SECONDS
                  [--journal-lines N] [--interval SECONDS]

Ready means `GET http://127.0.0.1:PORT/v1/models` lists MODEL (vLLM answers /health as soon as
the process is up, long before the model is loaded). It prints the elapsed time while it waits and
when the model is listed (exit 0). It gives up (exit 1) when the timeout passes, or at once when
the unit has stopped or restarted since the gate began (a crash at start: Restart= would bring it
back and the wait would only see the same crash again), with the unit's last journal lines, so the
message carries the cause (an OOM, a missing nvcc, a bad flag), not just "timeout".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

STATE_PROPS = ["ActiveState", "SubState", "NRestarts", "ExecMainPID", "Result",
               "ExecMainStatus", "InvocationID"]


def unit_state(unit: str) -> dict[str, str]:
    out = subprocess.run(["systemctl", "show", *(f"--property={p}" for p in STATE_PROPS), unit],
                         capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def listed_models(port: int, timeout: float = 2.0) -> list[str] | None:
    """The ids /v1/models lists, or None when it does not answer with a JSON list."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=timeout) as r:
            return [m.get("id") for m in json.load(r).get("data", [])]
    except (OSError, ValueError, urllib.error.URLError, AttributeError):
        return None


def health(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError:
        return "no answer"


def journal(unit: str, lines: int) -> str:
    out = subprocess.run(["journalctl", "--unit", unit, "--lines", str(lines), "--no-pager",
                          "--output", "short-iso", "--quiet"], capture_output=True, text=True)
    return (out.stdout or out.stderr).rstrip()


def stopped_or_restarted(start: dict[str, str], now: dict[str, str]) -> str | None:
    """Why the unit can no longer become ready from the start the gate is waiting on."""
    if now.get("ActiveState") in ("failed", "inactive"):
        return (f"{now.get('ActiveState')} (result {now.get('Result')}, "
                f"exit status {now.get('ExecMainStatus')})")
    if now.get("SubState") == "auto-restart":
        return (f"its process exited (status {now.get('ExecMainStatus')}, result "
                f"{now.get('Result')}); systemd will restart it")
    if now.get("NRestarts") != start.get("NRestarts") or (
            start.get("ExecMainPID") not in ("", "0")
            and now.get("ExecMainPID") not in ("", "0", start.get("ExecMainPID"))):
        return (f"restarted by systemd (last exit status {now.get('ExecMainStatus')}, "
                f"{now.get('NRestarts')} restarts)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--journal-lines", type=int, default=25)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--report-every", type=float, default=10.0)
    args = parser.parse_args(argv)

    began = time.monotonic()
    start = unit_state(args.unit)
    print(f"ready gate: waiting for {args.unit} to list {args.model} on "
          f"127.0.0.1:{args.port}/v1/models (up to {args.timeout:g} s)", flush=True)
    next_report = began + args.report_every
    why = None
    while True:
        elapsed = time.monotonic() - began
        models = listed_models(args.port)
        if models is not None and args.model in models:
            print(f"ready gate: {args.unit} ready after {elapsed:.1f} s "
                  f"({args.model} listed)", flush=True)
            return 0
        why = stopped_or_restarted(start, unit_state(args.unit))
        if why:
            break
        if elapsed >= args.timeout:
            why = (f"not ready after {elapsed:.0f} s (timeout); /health: {health(args.port)}, "
                   f"/v1/models lists {models if models is not None else 'nothing (no answer)'}")
            break
        if time.monotonic() >= next_report:
            print(f"ready gate: {args.unit} not ready after {elapsed:.0f} s (/health: "
                  f"{health(args.port)}, model listed: no)", flush=True)
            next_report += args.report_every
        time.sleep(args.interval)
    print(f"ready gate: {args.unit} did not become ready: {why}; its last journal lines:\n"
          f"{journal(args.unit, args.journal_lines)}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
