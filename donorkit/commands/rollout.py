"""Rolling rollout (`make rollout`): the fleet deployed a batch at a time, each batch back in
service before the next one starts, stopping at the first failure, without dropping a request
through the edges and never leaving a hostname with no box (docs/reference.md "Weights,
readiness and rolling rollouts" says how: batches, drain, lock, resume).

    .venv/bin/python -m donorkit.commands.rollout [--inventory FILE] [--batch N] [--from HOST]
                                         [--plan] [--unlock] [-- extra pyinfra arguments]

The plan is donorkit/commands/rollout_plan.py, the hosts donorkit/commands/rollout_hosts.py.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

from donorkit.commands.rollout_hosts import RolloutHosts, Unreachable
from donorkit.commands.rollout_plan import (
    DEFAULT_INVENTORY,
    Box,
    RolloutLocked,
    inventory_hosts,
    lock_path,
    new_holder,
    plan_batches,
    plan_text,
    resume_command,
    stopped_at,
    unlock_command,
)
from donorkit.inventory.paths import REPO_ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default=DEFAULT_INVENTORY)
    parser.add_argument("--batch", type=int, help="boxes at a time (default: inventory data)")
    parser.add_argument("--from", dest="start", help="resume: skip the boxes before this one")
    parser.add_argument("--in-service-timeout", type=float,
                        help="seconds a box may take to serve through Caddy after its run")
    parser.add_argument("--plan", action="store_true",
                        help="print the batches and what each takes out; connect to nothing")
    parser.add_argument("--unlock", action="store_true",
                        help="remove a stale rollout lock from every donor (a driver that died)")
    parser.add_argument("pyinfra_args", nargs="*", help="after --: passed to pyinfra")
    args = parser.parse_args(argv)

    boxes, edges = inventory_hosts(args.inventory)
    if not boxes:
        print("rollout: the inventory has no donors", file=sys.stderr)
        return 2
    first = boxes[0].data
    size = args.batch or first.rollout_batch_size
    if size < 1:
        parser.error("--batch must be 1 or more")
    timeout = args.in_service_timeout or float(first.rollout_in_service_timeout)
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
    if args.plan:
        print(f"rollout: plan only ({args.inventory}): nothing is touched", flush=True)
        print("\n".join(plan_text(batches, edges, serving)), flush=True)
        return 0

    # paramiko's transport thread logs a failed handshake with a traceback; Unreachable says it.
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
    fleet = RolloutHosts(boxes, edges)
    if args.unlock:
        return unlock_all(fleet)
    holder = new_holder()
    try:
        fleet.lock([b for batch in batches for b in batch], holder)
        print(f"rollout: locked {len(fleet.locked)} boxes for {holder}", flush=True)
        return run_batches(args, fleet, batches, serving, timeout)
    except RolloutLocked as exc:
        print(f"rollout: refused: {exc} (if that rollout is gone: make rollout UNLOCK=1)",
              file=sys.stderr, flush=True)
        return 2
    except Unreachable as exc:
        print(f"\nrollout: STOPPED: {exc}" + stopped_at(args), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nrollout: INTERRUPTED" + stopped_at(args), file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # SSH to a box or an edge: paramiko's errors, OSError, ours
        print(f"\nrollout: STOPPED: {type(exc).__name__}: {exc}" + stopped_at(args),
              file=sys.stderr, flush=True)
        return 1
    finally:
        try:
            fleet.unlock(holder)
        except Exception as exc:  # noqa: BLE001 - said, not raised: the run's outcome stands
            print(f"rollout: could not remove every lock ({type(exc).__name__}: {exc}); "
                  "clear them with: make rollout UNLOCK=1", file=sys.stderr, flush=True)
        fleet.close()


def unlock_all(fleet: RolloutHosts) -> int:
    """--unlock: remove every donor's rollout lock, saying whose it was; 1 if a box could not
    be asked."""
    failed = 0
    try:
        for box in fleet.boxes:
            try:
                rc, out = fleet.remote(box).run(unlock_command(lock_path(box), None))
            except Exception as exc:  # noqa: BLE001 - SSH: said per box, the others still asked
                rc, out = 1, f"{type(exc).__name__}: {exc}"
            held = out.strip().removeprefix("held by ")
            failed += rc != 0
            print(f"rollout: {box.name}: " + (f"failed: {held}" if rc != 0 else
                                              f"removed the lock of {held}" if held else
                                              "no lock"), flush=True)
    finally:
        fleet.close()
    return 1 if failed else 0


def run_batches(args, fleet: RolloutHosts, batches: list[list[Box]], serving: dict[str, list[Box]],
                timeout: float) -> int:
    done: list[tuple[str, float]] = []
    began = time.monotonic()
    for number, batch in enumerate(batches, 1):
        names = [b.name for b in batch]
        args.current = batch
        # A hostname is never left with no box: its other boxes must be serving now.
        for box in batch:
            for hostname in box.routes:
                others = [o for o in serving[hostname] if o.name not in names]
                if not others:
                    print(f"rollout: {hostname} is served by {box.name} alone: it is out of "
                          "service while that box restarts", flush=True)
                for other in others:
                    why = fleet.in_service(other)
                    if why:
                        return report(args, done, batch, f"{other.name} does not serve ({why}); "
                                      f"deploying {box.name} now would leave {hostname} with no "
                                      "box", batches[number - 1:], began)
        print(f"rollout: batch {number}/{len(batches)}: {', '.join(names)}", flush=True)
        started = time.monotonic()
        taken_out: dict[str, dict[str, float]] = {}
        for index, box in enumerate(batch):
            taken_out[box.name], why = fleet.take_out(box, timeout)
            if why:
                # Its flag, and the flags of the boxes before it in this batch, exist: each
                # stays out of the pools until a run of it succeeds, so resume from the first.
                return report(args, done, batch[:index + 1], f"{box.name} not taken out of "
                              f"the edges' pools: {why} (out of them until a run succeeds: "
                              f"{', '.join(b.name for b in batch[:index + 1])})",
                              batches[number - 1:], began)
            if taken_out[box.name]:
                print(f"rollout: {box.name} out of the pools of "
                      f"{', '.join(taken_out[box.name])}, nothing in flight to it", flush=True)
        command = [str(Path(sys.executable).parent / "pyinfra"), "-y", args.inventory,
                   "deploy.py", *(f"--limit={n}" for n in names), *args.pyinfra_args]
        rc = subprocess.run(command, cwd=REPO_ROOT).returncode
        if rc != 0:
            return report(args, done, batch, f"pyinfra exited {rc} (its output above names the "
                          "host and the step)", batches[number - 1:], began)
        for box in batch:
            why = fleet.wait_in_service(box, timeout)
            if why:
                return report(args, done, [box], f"not serving through its Caddy after "
                              f"{timeout:g} s: {why}", batches[number - 1:], began)
            why = fleet.wait_back(box, taken_out[box.name], timeout)
            if why:
                return report(args, done, [box], f"not back in the edges' pools after "
                              f"{timeout:g} s: {why}", batches[number - 1:], began)
            if taken_out[box.name]:
                print(f"rollout: {box.name} back in the pools of "
                      f"{', '.join(taken_out[box.name])} (their health checks)", flush=True)
        took = time.monotonic() - started
        done += [(n, took) for n in names]
        print(f"rollout: batch {number} in service after {took:.1f} s", flush=True)
    args.current = None
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
