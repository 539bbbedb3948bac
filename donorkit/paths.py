"""Paths on the operator's machine: a relative one is relative to the repository's root (where
deploy.py lives), whatever directory pyinfra was started from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(path: str | Path) -> Path:
    """`path` made absolute: `~` expanded, a relative path taken from the repository root."""
    return (REPO_ROOT / Path(path).expanduser()).resolve()


def pki_dir(data: Any) -> Path:  # a DonorBox or an EdgeBox (donorkit/host_data.py)
    """The private CA's folder on the operator's machine, from a host's `pki_dir`: the ONE reading
    of that setting (deploy, render, rollout, accept, verify): `~` is the operator's home, a
    relative path is under the repository."""
    return repo_path(data.pki_dir)
