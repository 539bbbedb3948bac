"""The benchmark's stock comparison (not for deploys): the fleet of $DONORS_FILE, as
inventory/gpus.py loads it, with pyinfra's own SSH sockets and every fact read its own remote
command (the snapshot off), so `pyinfra bench/stock_inventory.py deploy.py` runs our
operations the way stock pyinfra would read their facts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from donorkit.inventory import fleet_or_exit, pyinfra_groups  # noqa: E402
from pyinfra_snapshot import snapshot  # noqa: E402

snapshot.disable()
globals().update(pyinfra_groups(fleet_or_exit(), connect_kwargs={}))
