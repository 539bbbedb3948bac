"""The local test hosts as a pyinfra inventory (tests/testbed/donors.yml; `make testbed` starts
them). Same loader and validation as inventory/gpus.py; only the data file differs.

Usage: pyinfra inventory/testbed.py deploy.py
"""


from donorkit.inventory import inventory_or_exit, pyinfra_groups
from donorkit.paths import REPO_ROOT

globals().update(pyinfra_groups(*inventory_or_exit(REPO_ROOT / "tests/testbed/donors.yml")))
