"""The donor-box operations, pyinfra's way (pyinfra_declared/json_cases.py): arguments and facts
in, exact commands out. exllamav3's four steps share a case file: the box as it is before any of
them ran, and what each step does on its own from there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from donorkit.box import box_operations
from donorkit.box.box_operations import Exllamav3Build
from pyinfra_declared.json_cases import check_case, plan, refusal_message

HERE = Path(__file__).parent / "operations"
CASES = sorted(p for p in HERE.glob("*/*.json") if p.parent.name != "exllamav3")
WHEEL_CASES = sorted((HERE / "exllamav3").glob("*.json"))
STEPS = ("upload_cached_wheel", "build_wheel", "install_wheel", "copy_wheel_back")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.stem}" for c in CASES])
def test_operation(case: Path) -> None:
    check_case(getattr(box_operations, case.parent.name), case)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("case", WHEEL_CASES, ids=[c.stem for c in WHEEL_CASES])
def test_exllamav3_step(case: Path, step: str) -> None:
    spec = json.loads(case.read_text())
    build = Exllamav3Build(**{**spec["build"], "patches": tuple(spec["build"]["patches"]),
                              "builders": tuple(spec["build"]["builders"])})
    args = {"build": build, **spec["args"].get(step, {})}
    commands, noops = plan(getattr(box_operations, step), args, spec["facts"])
    want = spec["steps"][step]
    if "error" in want:
        assert re.search(want["error"], refusal_message(commands)), commands
        return
    assert commands == want["commands"]
    assert bool(noops) == (want["commands"] == [])
