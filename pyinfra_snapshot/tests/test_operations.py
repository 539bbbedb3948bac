"""The generic operations, pyinfra's way: arguments and facts in, exact commands out; a
converged host yields no command (that is what makes a re-run report zero changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyinfra_snapshot import operations
from pyinfra_snapshot.testing import check_case

CASES = sorted((Path(__file__).parent / "operations").glob("*/*.json"))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.stem}" for c in CASES])
def test_operation(case: Path) -> None:
    check_case(getattr(operations, case.parent.name), case)
