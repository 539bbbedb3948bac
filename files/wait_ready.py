"""The readiness gate: wait until a vLLM unit's loopback port lists its checkpoint.

Run on the box by the deploy right after the unit was (re)started, as root (it reads the unit's
journal), with the system python3 (stdlib only). Ready: `GET /v1/models` lists the model (vLLM
answers /health long before it is loaded) and then warm_up's requests are answered. It gives up
(exit 1) at the timeout, at once when the unit stopped or restarted (stopped_or_restarted) or a
warm-up request failed, with the unit's last journal lines: the cause, not just "timeout".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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


def exec_start_option(unit: str, name: str, default: int) -> int:
    """`name`'s value in the unit's ExecStart (systemd shows it as `{ path=... ; argv[]=WORDS ;
    ... }`), or `default` when absent or not a number."""
    out = subprocess.run(["systemctl", "show", "--property=ExecStart", unit], capture_output=True,
                         text=True).stdout
    words = out.split("argv[]=", 1)[1].split(" ;", 1)[0].split() if "argv[]=" in out else []
    for i, word in enumerate(words[:-1]):
        if word == name and words[i + 1].isdigit():
            return int(words[i + 1])
    return default


def complete(port: int, model: str, prompt: str, max_tokens: int, timeout: float) -> str | None:
    """One chat completion; None when it was answered, else why not."""
    body = json.dumps({"model": model, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return None if json.load(r).get("choices") else "an answer without choices"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def warm_up(port: int, model: str, seqs: int, max_len: int, timeout: float) -> str | None:
    """The warm-up requests, sent before the box goes back into its pools, because a cold vLLM
    compiles kernels during its first requests (Triton's; docs/benchmarks.md): a short prompt, a
    long one (half the unit's --max-model-len in characters, at most 16,000), then --max-num-seqs
    short ones at once (the decode batch the unit allows; both numbers read from the unit's
    ExecStart). None when every one was answered."""
    long_prompt = " ".join(f"w{i}" for i in range(max(1, min(max_len // 2, 16000) // 7)))
    steps = [[("Say hello.", 8)], [(long_prompt, 8)], [("Count to ten.", 16)] * max(1, seqs)]
    deadline = time.monotonic() + timeout
    for batch in steps:
        left = [max(deadline - time.monotonic(), 1.0)] * len(batch)
        with ThreadPoolExecutor(len(batch)) as pool:
            errors = [e for e in pool.map(complete, [port] * len(batch), [model] * len(batch),
                                          [p for p, _ in batch], [m for _, m in batch], left) if e]
        if errors:
            return f"{len(errors)} of {len(batch)} warm-up request(s) failed: {errors[0]}"
    return None


def stopped_or_restarted(start: dict[str, str], now: dict[str, str]) -> str | None:
    """Why the unit can no longer become ready from the start the gate is waiting on (a crash at
    start: Restart= would bring it back and the wait would only see the same crash again)."""
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
            print(f"ready gate: {args.unit} lists {args.model} after {elapsed:.1f} s; "
                  "warming up", flush=True)
            seqs = exec_start_option(args.unit, "--max-num-seqs", 1)
            max_len = exec_start_option(args.unit, "--max-model-len", 4096)
            why = warm_up(args.port, args.model, seqs, max_len,
                          max(args.timeout - elapsed, 60.0))
            if why is None:
                print(f"ready gate: {args.unit} ready after {time.monotonic() - began:.1f} s "
                      f"({args.model} listed and answered {seqs + 2} warm-up requests)",
                      flush=True)
                return 0
            why = f"listed, but the warm-up was not answered: {why}"
            break
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
