"""Turn the validated fleet into pyinfra inventory groups; exit with one clear line on mistakes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from donorkit.fleet import FleetError, load_fleet
from pyinfra_snapshot import ssh_socket


def fleet_or_exit(donors_path: Path | str | None = None,
                  require_local_sources: bool = True) -> dict[str, dict]:
    """load_fleet, but a user mistake ends the process with its message and no traceback."""
    try:
        return load_fleet(donors_path, require_local_sources=require_local_sources)
    except FleetError as exc:
        print(f"inventory error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def pyinfra_groups(fleet: dict[str, dict], connect_kwargs: dict[str, Any] | None = None
                   ) -> dict[str, list[tuple[str, dict]]]:
    """`donors` (every host) plus one group per card profile (e.g. `rtx4090`). Each host's SSH
    sockets get pyinfra_snapshot.ssh_socket's options, through pyinfra's own
    `ssh_paramiko_connect_kwargs` (`connect_kwargs` replaces them: the benchmark's stock run)."""
    if connect_kwargs is None:
        connect_kwargs = ssh_socket.connect_kwargs()
    groups: dict[str, list[tuple[str, dict]]] = {"donors": []}
    for name, fleet_data in fleet.items():
        data = {**fleet_data, "ssh_paramiko_connect_kwargs": connect_kwargs}
        groups["donors"].append((name, data))
        groups.setdefault(data["card"]["name"], []).append((name, data))
    return groups
