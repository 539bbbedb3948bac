"""Turn the validated fleet into pyinfra inventory groups; exit with one clear line on mistakes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from donorkit.inventory.fleet import FleetError, check_revisions, load_inventory
from donorkit.inventory.host_data import DonorBox, EdgeBox
from donorkit.inventory.limit import groups
from donorkit.inventory.paths import operator_path, pki_dir
from donorkit.inventory.pki import Pki, PkiError
from donorkit.render.tunnel_files import write_ssh_config
from pyinfra_declared import ssh_socket

# Where the inventory writes each home donor's ssh_config (git-ignored).
SSH_CONFIG_DIR = ".uncloseai/ssh"


def fleet_or_exit(donors_path: Path | str | None = None,
                  require_local_sources: bool = True) -> dict[str, DonorBox]:
    """The donors of inventory_or_exit."""
    return inventory_or_exit(donors_path, require_local_sources)[0]


def inventory_or_exit(donors_path: Path | str | None = None, require_local_sources: bool = True,
                      require_revisions: bool = True
                      ) -> tuple[dict[str, DonorBox], dict[str, EdgeBox]]:
    """load_inventory (donors, edges), but a user mistake ends the process with its message and
    no traceback. A donor serving a model with no pinned revision is such a mistake for
    everything that deploys (`make render` previews without: `require_revisions=False`)."""
    try:
        fleet, edges = load_inventory(donors_path, require_local_sources=require_local_sources)
        if require_revisions:
            check_revisions(fleet, donors_path)
    except FleetError as exc:
        print(f"inventory error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for directory in sorted({pki_dir(data) for data in [*fleet.values(), *edges.values()]}):
        try:
            Pki(directory).check()
        except PkiError as exc:
            print(f"pki error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    return fleet, edges


def pyinfra_groups(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox] | None = None,
                   connect_kwargs: dict[str, Any] | None = None
                   ) -> dict[str, list[tuple[str, dict]]]:
    """`donors` (every GPU box) plus one group per card profile (e.g. `rtx4090`), and `edges`
    (the front doors; deploy.py gives them the edge's tasks only). Each host's SSH sockets get
    pyinfra_declared.ssh_socket's options, through pyinfra's own `ssh_paramiko_connect_kwargs`
    (`connect_kwargs` replaces them: the benchmark's stock run). A host's data is its typed
    model's fields (donorkit/inventory/host_data.py: `pyinfra_data`)."""
    if connect_kwargs is None:
        connect_kwargs = ssh_socket.connect_kwargs()
    data: dict[str, dict] = {}
    for name, box in fleet.items():
        data[name] = {**box.pyinfra_data(), "ssh_paramiko_connect_kwargs": connect_kwargs}
        if box.ssh_proxy_command:
            # A home donor: SSH to its tunnel address through an edge (a ProxyJump in an
            # ssh_config file: pyinfra's public `ssh_config_file` host data).
            data[name]["ssh_config_file"] = write_ssh_config(box, operator_path(SSH_CONFIG_DIR))
    for name, edge in (edges or {}).items():
        data[name] = {**edge.pyinfra_data(), "ssh_paramiko_connect_kwargs": connect_kwargs}
    return {group: [(name, data[name]) for name in names]
            for group, names in groups(fleet, edges or {}).items()}
