"""The operation decorator and the pyinfra version check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyinfra_snapshot import UnsupportedPyinfra, check_pyinfra
from pyinfra_snapshot.facts import PathStates
from pyinfra_snapshot.operation import fail, operation
from pyinfra_snapshot.snapshot import need
from pyinfra_snapshot.testing import CaseHost, plan


def test_the_pyinfra_it_was_written_for_is_accepted() -> None:
    check_pyinfra("3.10.0")
    check_pyinfra("3.10")


@pytest.mark.parametrize("found", ["3.11.0", "3.1.0", "4.0", "2.9.7", None])
def test_another_pyinfra_is_refused_with_both_versions(found: str | None) -> None:
    with pytest.raises(UnsupportedPyinfra, match=r"written for pyinfra 3\.10\.x, but pyinfra "):
        check_pyinfra(found)


def test_the_import_itself_checks() -> None:
    """`import pyinfra_snapshot` under a pyinfra that reports another version stops there."""
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '3.11.0' if name == 'pyinfra' else real(name); "
            "import pyinfra_snapshot")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "UnsupportedPyinfra: pyinfra_snapshot was written for pyinfra 3.10.x, but pyinfra " \
           "3.11.0 is installed" in result.stderr


@operation(found=lambda op: need(PathStates, paths=[op.path]),
           digest=lambda op: need(PathStates, paths=[op.path], digest=[op.path])
           if op.check_content else None)
def example(path: str, found: dict, digest: dict | None, check_content: bool = False):
    yield f"first {path}"
    if path not in found:
        fail(f"{path} is missing")
    yield f"second {path}"


def test_facts_are_declared_from_the_arguments_alone() -> None:
    assert example.requests(path="/x") == {
        "found": (PathStates, {"paths": ["/x"]}), "digest": None}
    assert example.requests(path="/x", check_content=True)["digest"] == (
        PathStates, {"paths": ["/x"], "digest": ["/x"]})


def test_a_refusal_after_a_command_keeps_the_command_and_fails() -> None:
    commands, _ = plan(example, {"path": "/x"}, {"found": {}})
    assert commands[0] == "first /x"
    assert commands[1] == f"echo 'refused: {CaseHost.name}: /x is missing' >&2; exit 1"
    assert plan(example, {"path": "/x"}, {"found": {"/x": {}}})[0] == ["first /x", "second /x"]


def test_a_check_needs_no_yield() -> None:
    @operation()
    def check(ok: bool):
        if not ok:
            fail("not ok")

    assert plan(check, {"ok": True}, {})[0] == []
    assert plan(check, {"ok": False}, {})[0][0].startswith("echo 'refused: ")


def test_a_fact_without_its_parameter_is_refused_when_defined() -> None:
    with pytest.raises(TypeError, match=r"no parameter for the facts \['found'\]"):
        @operation(found=lambda op: need(PathStates, paths=[op.path]))
        def wrong(path: str):
            return None


def test_the_operation_takes_only_its_own_arguments() -> None:
    import inspect

    assert list(inspect.signature(example).parameters) == ["path", "check_content"]
