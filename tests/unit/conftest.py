"""Shared fixtures for the host-free tests."""

from __future__ import annotations

import pytest

from donorkit.inventory.paths import REPO_ROOT
from tests.support import old_paths

old_paths.install()  # tests.unit.make and the other helpers' old paths, for unmerged branches

# The checkout's own private CA (defaults.yml `pki_dir: pki`): the operator's keys. Tests keep
# their CAs in temporary folders; one that creates or changes anything here fails.
CHECKOUT_PKI = REPO_ROOT / "pki"


def _pki_state() -> list[tuple[str, int, int]] | None:
    if not CHECKOUT_PKI.exists() and not CHECKOUT_PKI.is_symlink():
        return None
    return sorted((str(p), p.lstat().st_mtime_ns, p.lstat().st_size)
                  for p in [CHECKOUT_PKI, *CHECKOUT_PKI.rglob("*")])


@pytest.fixture(autouse=True)
def _checkout_pki_untouched(request):
    """Fails the test that created or changed the checkout's pki/ (issue 21, hole 7)."""
    before = _pki_state()
    yield
    after = _pki_state()
    if after != before:
        what = "created" if before is None else "changed"
        pytest.fail(f"{request.node.nodeid} {what} the checkout's {CHECKOUT_PKI} (tests use "
                    "temporary folders only)", pytrace=False)
