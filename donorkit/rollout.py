"""Rolling rollout: the fleet deployed a batch at a time, each batch back in service before the
next one starts, stopping at the first failure.

    make rollout [BATCH=N] [FROM=HOST] [INVENTORY=inventory/gpus.py]
    .venv/bin/python -m donorkit.rollout [--inventory FILE] [--batch N] [--from HOST]
                                         [-- extra pyinfra arguments]

Each batch is one run of the real entry point, `pyinfra -y INVENTORY deploy.py --limit A
--limit B ...`: the deploy fetches weights before any unit restarts and passes each restarted
unit through its readiness gate (/v1/models on loopback lists the checkpoint), so a box that
does not come back fails its run with the cause. The driver then checks that each box of the
batch serves again from outside, through its GPU-side Caddy (https://BOX, the public hostname as
SNI and Host, verified with the private CA), for every hostname it serves; that is where the
edge's own health check seeing the box back will be added once edges exist (issue 15).

Batches: N boxes at a time (`--batch`, or `rollout_batch_size` in the inventory data), in
inventory order, never two boxes that serve the same public hostname in one batch. Before a batch
starts, every other box serving one of its hostnames must be serving now: a hostname is never
left with no box. A hostname that only one box serves is out of service while that box restarts
(said before it starts). At the first failure it prints what was done, what failed and the
command that resumes from there.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import runpy
import shlex
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INVENTORY = "inventory/gpus.py"


@dataclass
class Box:
    name: str
    data: dict

    @property
    def routes(self) -> dict[str, str]:
        """Public hostname -> the checkpoint served under it."""
        models = self.data["models"]
        return {r["hostname"]: models[r["model"]]["checkpoint"] for r in self.data["routes"]}


def load_boxes(inventory: str) -> list[Box]:
    """The inventory file's `donors` group, as pyinfra itself loads it (same file, same data)."""
    groups = runpy.run_path(str(REPO_ROOT / inventory))
    return [Box(name, data) for name, data in groups["donors"]]


def plan_batches(boxes: list[Box], size: int) -> list[list[Box]]:
    """Inventory order; each box in the earliest batch that has room and shares no hostname."""
    batches: list[list[Box]] = []
    for box in boxes:
        for batch in batches:
            if len(batch) < size and not any(set(box.routes) & set(b.routes) for b in batch):
                batch.append(box)
                break
        else:
            batches.append([box])
    return batches


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the box's address, with the public hostname as SNI and Host (as the edge does)."""

    def __init__(self, address: str, port: int, hostname: str, context: ssl.SSLContext,
                 timeout: float):
        super().__init__(hostname, port, context=context, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def gpu_side_check(box: Box, hostname: str, checkpoint: str, timeout: float = 5) -> str | None:
    """None when the box's Caddy lists `checkpoint` on /v1/models for `hostname`; else why."""
    ca = REPO_ROOT / box.data["pki_dir"] / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca))
    conn = _PinnedHTTPS(box.data["ssh_hostname"], int(box.data["caddy_https_port"]), hostname,
                        context, timeout)
    try:
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            return f"{hostname}: HTTP {response.status}"
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
        return None if checkpoint in ids else f"{hostname}: {checkpoint} not listed ({ids})"
    except (OSError, ValueError, http.client.HTTPException) as e:
        return f"{hostname}: {type(e).__name__}: {e}"
    finally:
        conn.close()


def in_service(box: Box) -> str | None:
    """None when every hostname of the box is served through it; else the first reason not.
    (An edge's health check for the box is added here when the inventory has edges.)"""
    for hostname, checkpoint in box.routes.items():
        why = gpu_side_check(box, hostname, checkpoint)
        if why:
            return why
    return None


def wait_in_service(box: Box, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        why = in_service(box)
        if why is None or time.monotonic() > deadline:
            return why
        time.sleep(1)


def resume_command(args, box: Box) -> str:
    """The command that goes on from `box` (the same fleet file: DONORS_FILE said again)."""
    donors = os.environ.get("DONORS_FILE")
    parts = ["make", "rollout", f"FROM={box.name}"]
    if args.batch:
        parts.append(f"BATCH={args.batch}")
    if args.inventory != DEFAULT_INVENTORY:
        parts.append(f"INVENTORY={args.inventory}")
    # An assignment word must stay unquoted before `=` for the shell to take it as one.
    return (f"DONORS_FILE={shlex.quote(donors)} " if donors else "") + shlex.join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default=DEFAULT_INVENTORY)
    parser.add_argument("--batch", type=int, help="boxes at a time (default: inventory data)")
    parser.add_argument("--from", dest="start", help="resume: skip the boxes before this one")
    parser.add_argument("--in-service-timeout", type=float,
                        help="seconds a box may take to serve through Caddy after its run")
    parser.add_argument("pyinfra_args", nargs="*", help="after --: passed to pyinfra")
    args = parser.parse_args(argv)

    boxes = load_boxes(args.inventory)
    if not boxes:
        print("rollout: the inventory has no donors", file=sys.stderr)
        return 2
    first = boxes[0].data
    size = args.batch or int(first.get("rollout_batch_size", 1))
    if size < 1:
        parser.error("--batch must be 1 or more")
    timeout = args.in_service_timeout or float(first.get("rollout_in_service_timeout", 120))
    batches = plan_batches(boxes, size)
    order = [b.name for batch in batches for b in batch]
    if args.start:
        if args.start not in order:
            print(f"rollout: --from {args.start}: no such donor in {args.inventory} "
                  f"(donors: {', '.join(order)})", file=sys.stderr)
            return 2
        skip = set(order[:order.index(args.start)])
        batches = [[b for b in batch if b.name not in skip] for batch in batches]
        batches = [batch for batch in batches if batch]

    serving: dict[str, list[Box]] = {}
    for box in boxes:
        for hostname in box.routes:
            serving.setdefault(hostname, []).append(box)
    print(f"rollout: {len(order)} boxes, {size} at a time: "
          + " | ".join(", ".join(b.name for b in batch) for batch in batches), flush=True)

    done: list[tuple[str, float]] = []
    began = time.monotonic()
    for number, batch in enumerate(batches, 1):
        names = [b.name for b in batch]
        # A hostname is never left with no box: its other boxes must be serving now.
        for box in batch:
            for hostname in box.routes:
                others = [o for o in serving[hostname] if o.name not in names]
                if not others:
                    print(f"rollout: {hostname} is served by {box.name} alone: it is out of "
                          "service while that box restarts", flush=True)
                for other in others:
                    why = in_service(other)
                    if why:
                        return report(args, done, batch, f"{other.name} does not serve ({why}); "
                                      f"deploying {box.name} now would leave {hostname} with no "
                                      "box", batches[number - 1:], began)
        print(f"rollout: batch {number}/{len(batches)}: {', '.join(names)}", flush=True)
        started = time.monotonic()
        command = [str(Path(sys.executable).parent / "pyinfra"), "-y", args.inventory,
                   "deploy.py", *(f"--limit={n}" for n in names), *args.pyinfra_args]
        rc = subprocess.run(command, cwd=REPO_ROOT).returncode
        if rc != 0:
            return report(args, done, batch, f"pyinfra exited {rc} (its output above names the "
                          "host and the step)", batches[number - 1:], began)
        for box in batch:
            why = wait_in_service(box, timeout)
            if why:
                return report(args, done, [box], f"not serving through its Caddy after "
                              f"{timeout:g} s: {why}", batches[number - 1:], began)
        took = time.monotonic() - started
        done += [(n, took) for n in names]
        print(f"rollout: batch {number} in service after {took:.1f} s", flush=True)
    print(f"rollout: done, {len(done)} boxes in {time.monotonic() - began:.1f} s: "
          + ", ".join(n for n, _ in done), flush=True)
    return 0


def report(args, done, failed: list[Box], why: str, rest: list[list[Box]], began: float) -> int:
    failed_names = [b.name for b in failed]
    waiting = [b.name for batch in rest for b in batch if b.name not in failed_names]
    print(f"\nrollout: STOPPED after {time.monotonic() - began:.1f} s\n"
          f"  done:     {', '.join(f'{n} ({t:.0f} s)' for n, t in done) or 'none'}\n"
          f"  failed:   {', '.join(failed_names)}: {why}\n"
          f"  not started: {', '.join(waiting) or 'none'}\n"
          f"  resume with: {resume_command(args, failed[0])}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
