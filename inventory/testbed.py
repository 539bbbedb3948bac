"""The local test hosts as a pyinfra inventory (tests/testbed/donors.yml; `make testbed` starts
them). Same loader and validation as inventory/gpus.py; only the data file differs.

Usage: pyinfra inventory/testbed.py deploy.py
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from donorkit.inventory import inventory_or_exit, pyinfra_groups  # noqa: E402

globals().update(pyinfra_groups(*inventory_or_exit(REPO_ROOT / "tests/testbed/donors.yml")))
