"""Turn the validated fleet into pyinfra inventory groups; exit with one clear line on mistakes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from donorkit import ssh_nodelay
from donorkit.fleet import FleetError, load_fleet

# Every deploy loads its inventory through here: that is where our SSH speed-up is switched on.
# UNCLOSEAI_STOCK_SSH=1 leaves pyinfra's stock behaviour (the benchmark compares the two).
if os.environ.get("UNCLOSEAI_STOCK_SSH") != "1":
    ssh_nodelay.enable()


def fleet_or_exit(donors_path: Path | str | None = None,
                  require_local_sources: bool = True) -> dict[str, dict]:
    """load_fleet, but a user mistake ends the process with its message and no traceback."""
    try:
        return load_fleet(donors_path, require_local_sources=require_local_sources)
    except FleetError as exc:
        print(f"inventory error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def pyinfra_groups(fleet: dict[str, dict]) -> dict[str, list[tuple[str, dict]]]:
    """`donors` (every host) plus one group per card profile (e.g. `rtx4090`)."""
    groups: dict[str, list[tuple[str, dict]]] = {"donors": []}
    for name, data in fleet.items():
        groups["donors"].append((name, data))
        groups.setdefault(data["card"]["name"], []).append((name, data))
    return groups
