"""The fleet as a pyinfra inventory: inventory/donors.yml, or the file $DONORS_FILE names,
validated before any connection. Groups: `donors` (all GPU boxes), one per card (`rtx4090`,
...), and `edges` (the front doors, donors.yml `edges:`).

Usage: pyinfra inventory/gpus.py deploy.py [--limit HOST]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from donorkit.inventory import inventory_or_exit, pyinfra_groups  # noqa: E402

globals().update(pyinfra_groups(*inventory_or_exit()))
