"""The lent GPU box as a pyinfra inventory over the @local connector: the donor entry of
gpu/donors.yml (or $DONORS_FILE), loaded and validated by the same loader as the fleet.

Usage (on that box, from the repo root): pyinfra -y gpu/inventory.py gpu/deploy.py
"""

import os

from donorkit.box.inventory_groups import fleet_or_exit
from donorkit.inventory.paths import REPO_ROOT

_fleet = fleet_or_exit(os.environ.get("DONORS_FILE") or REPO_ROOT / "gpu/donors.yml",
                      require_local_sources=False)
device = [("@local", box.pyinfra_data()) for box in _fleet.values()]
