"""The local test hosts as a pyinfra inventory (tests/testbed/donors.yml; `make testbed` starts
them). Same loader and validation as inventory/gpus.py; only the data file differs.

Usage: pyinfra inventory/testbed.py deploy.py
"""


import logging

from donorkit.box.inventory_groups import inventory_or_exit, pyinfra_groups
from donorkit.inventory.paths import REPO_ROOT

# A box whose SSH port says nothing: pyinfra's one line (`SSH error (...)`), not paramiko's
# 20-line traceback of its transport thread.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
globals().update(pyinfra_groups(*inventory_or_exit(REPO_ROOT / "tests/testbed/donors.yml")))
