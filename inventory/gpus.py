"""The fleet as a pyinfra inventory: inventory/donors.yml, or the file $DONORS_FILE names,
validated before any connection. Groups: `donors` (all GPU boxes), one per card (`rtx4090`,
...), and `edges` (the front doors, donors.yml `edges:`).

Usage: pyinfra inventory/gpus.py deploy.py [--limit HOST]
"""


from donorkit.inventory import inventory_or_exit, pyinfra_groups

globals().update(pyinfra_groups(*inventory_or_exit()))
