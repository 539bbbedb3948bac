"""A home donor joining the tunnel, on the box itself (pyinfra's @local connector): the join file
$JOIN_FILE (written by the operator's `make join-file`), validated before anything runs; deploy.py
applies the tunnel only (tasks/tunnel.py). Run by `make join JOIN=<file>` as root on the box.

Usage: JOIN_FILE=join-<donor>.yml pyinfra -y inventory/join.py deploy.py
"""

import os
import sys
from pathlib import Path

from donorkit import schema
from donorkit.fleet import DEFAULTS_FILE, FleetError, read_yaml
from donorkit.host_data import DonorTunnel, TunnelPeer
from donorkit.inventory_files import validate
from donorkit.tunnel_join import read_join_file

try:
    _join = read_join_file(Path(os.environ.get("JOIN_FILE") or "JOIN_FILE is not set"))
    _defaults = validate(schema.Defaults, read_yaml(DEFAULTS_FILE), str(DEFAULTS_FILE))
except FleetError as exc:
    print(f"join error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

# The join file's tunnel as the typed data tasks/tunnel.py reads (validated by read_join_file);
# its public key is what this run prints, not known yet.
_tunnel = DonorTunnel.model_construct(
    **{**_join["tunnel"], "peers": [TunnelPeer.model_construct(**peer)
                                    for peer in _join["tunnel"]["peers"]]},
    public_key=None)

tunnel_join = [("@local", {
    "donor_name": _join["donor"],
    "tunnel": _tunnel,
    "tunnel_joining": True,
    "install_root": _defaults.install_root,
    "apt_lock_wait": _defaults.apt_lock_wait,
})]
