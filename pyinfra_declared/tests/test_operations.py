"""The generic operations, pyinfra's way: arguments and facts in, exact commands out; a
converged host yields no command (that is what makes a re-run report zero changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyinfra_declared import apt, files, python_env, services, sources
from pyinfra_declared.json_cases import check_case

MODULES = (apt, files, python_env, services, sources)

CASES = sorted((Path(__file__).parent / "operations").glob("*/*.json"))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.stem}" for c in CASES])
def test_operation(case: Path) -> None:
    [op] = [getattr(m, case.parent.name) for m in MODULES if hasattr(m, case.parent.name)]
    check_case(op, case)
