"""The rolling rollout's pure core (donorkit/commands/rollout.py drives it and is the command
line): the boxes and edges of an inventory, the batches and the plan's text, what an edge's health
checker and admin API say about a box, and the lock's commands. Nothing here connects anywhere;
what a rollout does and in which order is said in donorkit/commands/rollout.py."""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import runpy
import secrets
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from donorkit.inventory import values
from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import DonorBox, EdgeBox
from donorkit.inventory.paths import REPO_ROOT


@dataclass
class Box:
    name: str
    data: DonorBox

    @property
    def routes(self) -> dict[str, str]:
        """Public hostname -> the checkpoint served under it."""
        models = self.data.models
        return {r.hostname: models[r.model].checkpoint for r in self.data.routes}


@dataclass
class Edge:
    name: str
    data: EdgeBox

    def pool_of(self, box: Box) -> list[str]:
        """The upstream addresses (host:port, as the edge's Caddy logs them) under which this
        edge proxies to `box`: one per hostname it serves that the box routes."""
        return sorted({u.address for site in self.data.sites for u in site.upstreams
                       if u.donor == box.name})

    @property
    def health_wait(self) -> float:
        """Seconds in which every active health checker of the edge has checked once."""
        proxy = self.data.edge_proxy
        return seconds(proxy.health_interval) + seconds(proxy.health_timeout)


# A Caddy duration of the inventory (`2s`, `250ms`, `1m30s`) in seconds: the schema's own parser.
seconds = values.duration_seconds


def inventory_hosts(inventory: str) -> tuple[list[Box], list[Edge]]:
    """The inventory file's `donors` and `edges` groups, as pyinfra itself loads them (same
    file, same data), each host's data typed again (donorkit/inventory/host_data.py)."""
    groups = runpy.run_path(str(REPO_ROOT / inventory))
    return ([Box(name, DonorBox.from_pyinfra(data)) for name, data in groups["donors"]],
            [Edge(name, EdgeBox.from_pyinfra(data)) for name, data in groups.get("edges", [])])


def load_boxes(inventory: str) -> list[Box]:
    return inventory_hosts(inventory)[0]


# --- the edge's view of a box -----------------------------------------------------------------
HEALTH_LOGGER = "http.handlers.reverse_proxy.health_checker.active"


def health_events(journal: str, address: str) -> list[tuple[float, bool]]:
    """(time, up) of the edge's active health checker's lines about `address`, from Caddy's JSON
    log (`journalctl -o cat`). Caddy 2.6.2 and 2.11.7 alike log "host is up" when a failing
    upstream passes again, and one line per failed check ("unexpected status code", "HTTP
    request failed", ...) at every interval while it fails; nothing while it stays healthy."""
    events = []
    for line in journal.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == HEALTH_LOGGER and entry.get("host") == address:
            events.append((float(entry["ts"]), entry.get("msg") == "host is up"))
    return events


def edge_sees(events: list[tuple[float, bool]], since: float, now: float,
              settle: float) -> str | None:
    """"down" once a check failed after `since`; "up" once the last line after `since` is "host
    is up" and `settle` seconds (every checker's turn) have passed since it with no failure;
    None while neither can be said yet."""
    after = [(at, up) for at, up in events if at > since]
    if not after:
        return None
    at, up = after[-1]
    if not up:
        return "down"
    return "up" if now - at >= settle else None


def upstream_requests(upstreams_json: str, address: str) -> int | None:
    """Requests the edge has in flight to `address` (its admin API's /reverse_proxy/upstreams,
    the same shape on 2.6 and 2.11); None when the address is not in its pools."""
    for upstream in json.loads(upstreams_json):
        if upstream.get("address") == address:
            return int(upstream.get("num_requests", 0))
    return None


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


def plan_text(batches: list[list[Box]], edges: list[Edge],
              serving: dict[str, list[Box]]) -> list[str]:
    """What a rollout of `batches` would do, batch by batch: which box leaves which edge's pools
    (its drain flag) and comes back, and what each of its hostnames runs on meanwhile."""
    lines = []
    for number, batch in enumerate(batches, 1):
        lines.append(f"batch {number}/{len(batches)}: {', '.join(b.name for b in batch)}")
        for box in batch:
            pools = sorted({e.name for e in edges if e.pool_of(box)})
            lines.append(f"  {box.name}: " + (
                f"out of the pools of {', '.join(pools)}, deployed, back in them"
                if pools else "in no edge's pool: deployed"))
            for hostname in box.routes:
                others = [o.name for o in serving[hostname] if o.name != box.name]
                if not others:
                    note = f"out of service while {box.name} restarts (no other box serves it)"
                elif len(others) == 1:
                    note = f"runs on one box, {others[0]}, while {box.name} restarts"
                else:
                    note = f"runs on {len(others)} boxes ({', '.join(others)})"
                lines.append(f"    {hostname}: {note}")
    return lines


def lock_path(box: Box) -> str:
    return f"{box.data.install_root}/state/rollout.lock"


def lock_command(path: str, holder: str) -> str:
    """Take the lock directory `path` (mkdir is atomic) and write `holder` into it; when it is
    there already, print its holder and exit 3."""
    lock, state = shlex.quote(path), shlex.quote(str(Path(path).parent))
    return (f"mkdir -p {state} && if mkdir {lock} 2>/dev/null; then "
            f"printf '%s\\n' {shlex.quote(holder)} > {lock}/holder; else "
            f"cat {lock}/holder 2>/dev/null || echo '(holder not written yet)'; exit 3; fi")


def unlock_command(path: str, holder: str | None) -> str:
    """Remove the lock `path`: only when `holder` holds it (None: whoever holds it, printing
    `held by <holder>` when there was one)."""
    lock = shlex.quote(path)
    if holder is None:
        return (f"if [ -d {lock} ]; then printf 'held by %s\\n' \"$(cat {lock}/holder "
                f"2>/dev/null || echo '(no holder written)')\"; rm -rf {lock}; fi")
    return (f"if [ \"$(head -n 1 {lock}/holder 2>/dev/null)\" = {shlex.quote(holder)} ]; "
            f"then rm -rf {lock}; fi")


def new_holder() -> str:
    """Who holds the lock: user@machine, process id, start time (UTC) and a random token, so
    a driver removes its own locks only."""
    since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()} since {since} "
            f"({secrets.token_hex(4)})")


class RolloutLocked(DonorsError):
    """Another rollout holds a box's lock; the message is the one line to print."""


DEFAULT_INVENTORY = "inventory/gpus.py"


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


def stopped_at(args) -> str:
    """The resume line for a run stopped from outside the batch loop's own checks: from the
    first box of the batch under way (any of its boxes may be out of the pools)."""
    at = getattr(args, "current", None)
    if not at:
        return ""
    return (f"\n  in batch: {', '.join(b.name for b in at)} (any of them may be out of the "
            f"edges' pools until a run of it succeeds)\n"
            f"  resume with: {resume_command(args, at[0])}")
