"""Benchmark (not a test): a rolling rollout's cost, on testbed hosts.

    flock /tmp/uncloseai-testbed.lock .venv/bin/python -m bench.rollout [--hosts 4]
                                                    [--load-delay 5] [--sizes 2,4]

Brings up N testbed hosts of the rtx4090 stack, all serving ONE public hostname, converges them
with the real entry point (`pyinfra inventory/gpus.py deploy.py`, DONORS_FILE naming a generated
donors file; the stand-in vLLM takes --load-delay seconds to list its model after a start), then
for each size in --sizes: `python -m donorkit.commands.rollout` over the first `size` boxes, one at
a time, with a change that restarts vLLM on every box (the load delay moves by 0.5 s), while a
bounded request loop asks each box's GPU-side Caddy for /v1/models. Prints, per rollout: the whole
time, each box's out-of-service window (its journal: unit stop to the model listed), the requests
sent and failed per box, and the rounds in which no box answered (what a client failing over between
the boxes, as an edge does, would have seen fail).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from donorkit.commands.rollout_plan import Box, load_boxes
from donorkit.inventory.paths import REPO_ROOT, pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from tests.support import hosts as bed
from tests.support.deploy import run_deploy
from tests.support.rollout_watch import RequestLoop, outages, overlapping

BIN = Path(sys.executable).parent
WORK = REPO_ROOT / ".testbed"
TEMPLATE = REPO_ROOT / "tests/testbed/donors.yml"
HOSTNAME = "bench.ai.unturf.com"


def donors_file(names: list[tuple[str, str]], delay: float, path: Path) -> Path:
    doc = yaml.safe_load(TEMPLATE.read_text())
    model = doc["donors"]["tb-4090"]
    overrides = doc["overrides"]
    overrides.setdefault("models", {}).setdefault("qwen", {}).setdefault("environment", {})
    overrides["models"]["qwen"]["environment"]["VLLM_STANDIN_LOAD_DELAY"] = f"{delay:g}"
    doc["donors"] = {name: dict(model, ssh_host=ip, routes={HOSTNAME: "qwen"})
                     for name, ip in names}
    doc.pop("edges", None)  # no edge here: the loop asks each box's Caddy, as an edge would
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(cmd: list[str], env_file: Path, timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env={**os.environ, "DONORS_FILE": str(env_file)},
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--load-delay", type=float, default=5.0)
    parser.add_argument("--sizes", default="2,4")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [(f"tb-r{i}", f"10.213.0.{30 + i}") for i in range(1, args.hosts + 1)]
    donors = WORK / "bench-rollout-donors.yml"
    with bed.testbed(names) as started:
        hosts = {h.name: h for h in started}
        delay = args.load_delay
        donors_file(names, delay, donors)
        rc, _, out, took = run_deploy(donors=donors, json_report=False, timeout=3600)
        if rc != 0:
            print(out[-6000:])
            return 1
        print(f"converged {len(names)} hosts in {took:.0f} s", flush=True)
        for size in sizes:
            subset = names[:size]
            delay += 0.5  # the change: the units' environment, so every vLLM restarts
            donors_file(subset, delay, donors)
            os.environ["DONORS_FILE"] = str(donors)
            boxes: list[Box] = load_boxes("inventory/gpus.py")
            since = time.time() - 1
            # Donors answer only the current edges' and the operator's certificates.
            pair = tuple(str(p) for p in Pki(pki_dir(boxes[0].data)).client_pair(OPERATOR_CLIENT))
            with RequestLoop(boxes, HOSTNAME, boxes[0].routes[HOSTNAME], client=pair) as loop:
                rc, out, took = run([str(BIN / "python"), "-m", "donorkit.commands.rollout",
                                     "--inventory", "inventory/gpus.py"], donors, 3600)
                time.sleep(1)
            if rc != 0:
                print(out[-6000:])
                return 1
            windows = {n: outages(hosts[n], "vllm-qwen.service", since) for n, _ in subset}
            spans = [end - start for ws in windows.values() for start, end in ws if end]
            per_box = ", ".join(f"{n} " + "/".join(f"{(e or time.time()) - s:.1f}" for s, e in ws)
                                for n, ws in windows.items())
            median = f"; median {statistics.median(spans):.1f} s" if spans else ""
            print(f"rollout of {size} boxes: {took:.1f} s; out of service per box (s): "
                  f"{per_box}{median}", flush=True)
            print(f"  requests: {loop.summary()}", flush=True)
            clashes = overlapping(windows)
            print(f"  boxes down together: {clashes or 'never'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
