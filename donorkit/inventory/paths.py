"""Paths on the operator's machine. Two kinds:

- the toolkit's own (templates/, files/, inventory/defaults.yml): relative to the repository's
  root (where deploy.py lives), whatever directory a command was started from: `repo_path`;
- the operator's data (the donors file, pki_dir, the caches, results, hf_token_file, SSH keys,
  a plugin checkout): relative to the fleet directory, `donors --fleet DIR` or $DONORS_FLEET,
  where one is set; else (the example inventory, the testbed, old scripts) to the repository's
  root as before: `operator_path`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]  # donorkit/inventory/paths.py
# The operator's data directory (`donors init DIR` makes one): its donors.yml is the inventory.
FLEET_ENV = "DONORS_FLEET"
FLEET_DONORS = "donors.yml"


def repo_path(path: str | Path) -> Path:
    """`path` made absolute: `~` expanded, a relative path taken from the repository root."""
    return (REPO_ROOT / Path(path).expanduser()).resolve()


def fleet_dir() -> Path | None:
    """The fleet directory $DONORS_FLEET names (absolute), or None."""
    value = os.environ.get(FLEET_ENV)
    return Path(value).expanduser().resolve() if value else None


def operator_path(path: str | Path) -> Path:
    """An operator's path made absolute: `~` expanded, a relative one taken from the fleet
    directory, or from the repository root where no fleet directory is set."""
    return ((fleet_dir() or REPO_ROOT) / Path(path).expanduser()).resolve()


def donors_file() -> Path:
    """The inventory: $DONORS_FILE, else the fleet directory's donors.yml, else the example
    inventory/donors.yml."""
    if os.environ.get("DONORS_FILE"):
        return Path(os.environ["DONORS_FILE"])
    fleet = fleet_dir()
    return fleet / FLEET_DONORS if fleet else REPO_ROOT / "inventory" / "donors.yml"


def pki_dir(data: Any) -> Path:  # a DonorBox or an EdgeBox (donorkit/inventory/host_data.py)
    """The private CA's folder on the operator's machine, from a host's `pki_dir`: the ONE reading
    of that setting (deploy, render, rollout, accept, verify): `~` is the operator's home, a
    relative path is under the fleet directory (or the repository, with none)."""
    return operator_path(data.pki_dir)
