"""The converged fleet: its five hosts started once for every scenario of this package and
converged through the real entry point (converged.py), torn down after the last one."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from donorkit.inventory.paths import REPO_ROOT
from tests.support import hosts as bed
from tests.support.hosts import Host
from tests.testbed.fleet.converged import Fleet, Record, converge
from tests.testbed.fleet.helpers import HOSTS, OLD, OLD_DRIVER, TIMES


@pytest.fixture(scope="package")
def fleet() -> Iterator[Fleet]:
    """The five hosts up, converged through the real entry point (converged.Record), for every
    scenario of this package; torn down after the last one."""
    shutil.rmtree(REPO_ROOT / ".testbed/wheel-cache", ignore_errors=True)
    shutil.rmtree(REPO_ROOT / ".testbed/kernel-cache", ignore_errors=True)
    with bed.testbed(HOSTS, times=TIMES, drivers={OLD: OLD_DRIVER}) as started:
        hosts = {h.name: h for h in started}
        yield Fleet(hosts, converge(hosts))
    print("\ntestbed phase times: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))


@pytest.fixture
def hosts(fleet: Fleet) -> dict[str, Host]:
    return fleet.hosts


@pytest.fixture
def record(fleet: Fleet) -> Record:
    return fleet.record
