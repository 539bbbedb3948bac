"""The fleet as a pyinfra inventory: $DONORS_FILE, else the fleet directory's donors.yml
($DONORS_FLEET, `donors --fleet`), else the example inventory/donors.yml; validated before any
connection. Groups: `donors` (all GPU boxes), one per card (`rtx4090`, ...), and `edges` (the
front doors, donors.yml `edges:`).

Usage: donors deploy [--limit HOST] (pyinfra inventory/gpus.py deploy.py [--limit HOST])
"""


import logging

from donorkit.box.inventory_groups import inventory_or_exit, pyinfra_groups

# A box whose SSH port says nothing: pyinfra's one line (`SSH error (...)`), not paramiko's
# 20-line traceback of its transport thread.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
globals().update(pyinfra_groups(*inventory_or_exit()))
