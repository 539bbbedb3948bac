"""Debian packages: apt-get once apt's and dpkg's locks are free (apt_get.sh), and a .deb from a
URL. Each yields no command when the host already has what it asks."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

from pyinfra import host

from pyinfra_declared.batched_facts import (
    DebStatus,
    PathStates,
)
from pyinfra_declared.decorator import operation
from pyinfra_declared.snapshot import need

# `apt_get_when_free WAIT ARGS...` (apt_get.sh): apt-get once apt's and dpkg's locks are free
# (waiting up to WAIT s, said on stderr), after finishing an interrupted dpkg. Prepended to each
# apt command.
APT_FUNCTIONS = (Path(__file__).resolve().parent / "apt_get.sh").read_text()


def _apt_get(lock_wait: int, *commands: str) -> str:
    """Shell running `apt-get <command>` for each, in order, through apt_get_when_free (the
    caller puts APT_FUNCTIONS first)."""
    return " && ".join(f"apt_get_when_free {int(lock_wait)} {c}" for c in commands)


q = shlex.quote


@operation(installed=lambda op: need(DebStatus, packages=op.packages))
def apt_install(packages: list[str], installed: set[str], lock_wait: int = 600):
    """Install the missing packages; refresh the lists only when something is missing. Each
    apt-get waits (up to `lock_wait` s) for apt's and dpkg's locks, and an interrupted dpkg is
    finished first (apt_get.sh)."""
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"installed: {' '.join(packages)}")
        return
    yield APT_FUNCTIONS + _apt_get(lock_wait, "update -q",
                                   f"install -y -q {' '.join(map(q, missing))}")


@operation(found=lambda op: need(PathStates, paths=[op.provides]))
def deb_from_url(url: str, provides: str, found: dict, lock_wait: int = 600):
    """Install a .deb fetched from `url` unless the file it provides is already there (apt
    waits for its locks as in apt_install)."""
    if found.get(provides):
        host.noop(f"{provides} present")
        return
    tmp = q(f"/tmp/pyinfra-deb-{hashlib.sha256(url.encode()).hexdigest()[:12]}.deb")
    yield (f"{APT_FUNCTIONS}curl -fsSL --retry 3 -o {tmp} {q(url)} && "
           f"{_apt_get(lock_wait, f'install -y -q {tmp}')}; rc=$?; rm -f {tmp}; exit $rc")
