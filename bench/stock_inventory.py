"""The benchmark's stock comparison (not for deploys): the fleet of $DONORS_FILE, as
inventory/gpus.py loads it, with pyinfra's own SSH sockets and every fact read its own remote
command (the snapshot off), so `pyinfra bench/stock_inventory.py deploy.py` runs our
operations the way stock pyinfra would read their facts."""


from donorkit.box.inventory_groups import fleet_or_exit, pyinfra_groups
from pyinfra_declared import snapshot

snapshot.disable()
globals().update(pyinfra_groups(fleet_or_exit(), connect_kwargs={}))
