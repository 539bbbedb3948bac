"""A home donor joining the tunnel, on the box itself (pyinfra's @local connector): the join file
$JOIN_FILE (written and signed by the operator's `make join-file`), checked whole and against
the operator's CA fingerprint $JOIN_FINGERPRINT before anything runs
(donorkit/commands/join_file.py); deploy.py applies the tunnel only (tasks/tunnel.py). Run by `make
join JOIN=<file> FINGERPRINT=<fp>` as root on the box.

Usage: JOIN_FILE=join-<donor>.yml JOIN_FINGERPRINT=<fp> pyinfra -y inventory/join.py deploy.py
"""

import os
import sys
from pathlib import Path

from donorkit.commands.join_file import donor_tunnel, read_join_file
from donorkit.inventory import schema
from donorkit.inventory.fleet import DEFAULTS_FILE, FleetError, read_yaml
from donorkit.inventory.inventory_files import validate

try:
    _join = read_join_file(Path(os.environ.get("JOIN_FILE") or "JOIN_FILE is not set"),
                           os.environ.get("JOIN_FINGERPRINT", ""))
    _defaults = validate(schema.Defaults, read_yaml(DEFAULTS_FILE), str(DEFAULTS_FILE))
except FleetError as exc:
    print(f"join error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

tunnel_join = [("@local", {
    "donor_name": _join.donor,
    # The join file's tunnel, with this checkout's packages (never the file's).
    "tunnel": donor_tunnel(_join, _defaults.tunnel),
    "tunnel_joining": True,
    "install_root": _defaults.install_root,
    "apt_lock_wait": _defaults.apt_lock_wait,
})]
