"""Turn the validated fleet into pyinfra inventory groups; exit with one clear line on mistakes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from donorkit import op_overhead, prefetch, ssh_socket
from donorkit.fleet import REPO_ROOT, FleetError, load_fleet
from donorkit.pki import Pki, PkiError

SPEEDUPS = {"ssh": ssh_socket, "op_overhead": op_overhead, "snapshot": prefetch}


def stock_behaviour(environ: dict[str, str]) -> set[str]:
    """Which speed-ups to leave off: UNCLOSEAI_STOCK=all or a comma list of SPEEDUPS' names
    (UNCLOSEAI_STOCK_SSH=1, the older switch, still means `ssh`). For the benchmark's stock
    comparison; a deploy never needs it."""
    names = {n.strip() for n in environ.get("UNCLOSEAI_STOCK", "").split(",") if n.strip()}
    if "all" in names:
        names = set(SPEEDUPS)
    if environ.get("UNCLOSEAI_STOCK_SSH") == "1":
        names.add("ssh")
    unknown = names - set(SPEEDUPS)
    if unknown:
        raise SystemExit(f"UNCLOSEAI_STOCK: unknown {', '.join(sorted(unknown))} "
                         f"(known: all, {', '.join(SPEEDUPS)})")
    return names


# Every deploy loads its inventory through here: that is where our speed-ups are switched on.
for _name, _module in SPEEDUPS.items():
    (_module.disable if _name in stock_behaviour(dict(os.environ)) else _module.enable)()


def fleet_or_exit(donors_path: Path | str | None = None,
                  require_local_sources: bool = True) -> dict[str, dict]:
    """load_fleet, but a user mistake ends the process with its message and no traceback."""
    try:
        fleet = load_fleet(donors_path, require_local_sources=require_local_sources)
    except FleetError as exc:
        print(f"inventory error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for pki_dir in sorted({data["pki_dir"] for data in fleet.values()}):
        try:
            Pki(REPO_ROOT / pki_dir).check()
        except PkiError as exc:
            print(f"pki error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    return fleet


def pyinfra_groups(fleet: dict[str, dict]) -> dict[str, list[tuple[str, dict]]]:
    """`donors` (every host) plus one group per card profile (e.g. `rtx4090`)."""
    groups: dict[str, list[tuple[str, dict]]] = {"donors": []}
    for name, fleet_data in fleet.items():
        data = {**fleet_data, "ssh_paramiko_connect_kwargs": ssh_socket.connect_kwargs()}
        groups["donors"].append((name, data))
        groups.setdefault(data["card"]["name"], []).append((name, data))
    return groups
