"""The operation decorator and the pyinfra version check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_declared import UnsupportedPyinfra, check_pyinfra
from pyinfra_declared.batched_facts import PathStates
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.json_cases import CaseHost, plan
from pyinfra_declared.snapshot import need


def test_the_pyinfra_it_was_written_for_is_accepted() -> None:
    check_pyinfra("3.10.0")
    check_pyinfra("3.10")


@pytest.mark.parametrize("found", ["3.11.0", "3.1.0", "4.0", "2.9.7", None])
def test_another_pyinfra_is_refused_with_both_versions(found: str | None) -> None:
    with pytest.raises(UnsupportedPyinfra, match=r"written for pyinfra 3\.10\.x, but pyinfra "):
        check_pyinfra(found)


def test_the_import_itself_checks() -> None:
    """`import pyinfra_declared` under a pyinfra that reports another version stops there."""
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '3.11.0' if name == 'pyinfra' else real(name); "
            "import pyinfra_declared")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "UnsupportedPyinfra: pyinfra_declared was written for pyinfra 3.10.x, but pyinfra " \
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


REFUSING_DEPLOY = '''
from pyinfra_declared.decorator import fail, operation


@operation()
def check_card(ok: bool):
    if not ok:
        fail("the card is not the profile's")


@operation()
def write(path: str):
    yield f"touch {path}"


check_card(name="Check the card", ok=False)
write(name="Write the marker", path=MARKER)
'''


def _pyinfra(tmp_path, *args: str) -> subprocess.CompletedProcess:
    deploy = tmp_path / "deploy.py"
    deploy.write_text(REFUSING_DEPLOY.replace("MARKER", repr(str(tmp_path / "marker"))))
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    return subprocess.run([pyinfra, "@local", str(deploy), *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120, input="n\n")


def test_a_refusal_is_a_refusal_in_the_preview_not_a_change(tmp_path) -> None:
    """pyinfra's own CLI, `--dry`: the host and the reason on one line; the refusing step and
    every step after it on that host proposed as no change."""
    result = _pyinfra(tmp_path, "--dry")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "refused: @local: the card is not the profile's (preview: this host stops" in out
    table = out.split("--> Detected changes:", 1)[1]
    for step in ("Check the card", "Write the marker"):
        row = next(line for line in table.splitlines() if step in line)
        assert "@local" not in row, row  # neither "Change" nor "Conditional Change"
    assert not (tmp_path / "marker").exists()


def test_a_refusal_stops_its_host_when_the_run_executes(tmp_path) -> None:
    result = _pyinfra(tmp_path, "-y")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "refused: @local: the card is not the profile's" in out
    assert not (tmp_path / "marker").exists()  # the step after the refusal did not run


def test_every_changed_file_of_one_operation_is_in_the_diff_preview(tmp_path) -> None:
    """config_files under `--dry --diff` with pyinfra's CLI: both changed files are shown (change
    detection stops at an operation's first command)."""
    one, two = tmp_path / "one.conf", tmp_path / "two.conf"
    one.write_text("old line\n")
    deploy = tmp_path / "deploy.py"
    deploy.write_text(
        "from pyinfra_declared.files import ConfigFile, config_files\n"
        f"config_files(name='Install both', files=[ConfigFile(content='new line\\n', "
        f"dest={str(one)!r}), ConfigFile(content='second\\n', dest={str(two)!r})])\n")
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    result = subprocess.run([pyinfra, "@local", str(deploy), "--dry", "--diff"], cwd=tmp_path,
                            text=True, capture_output=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"Will modify {one}" in out and f"Will create {two}" in out, out
    assert "new line" in out and "second" in out
    assert one.read_text() == "old line\n" and not two.exists()


def test_a_refusal_after_an_earlier_change_is_said_and_the_preview_goes_on(tmp_path) -> None:
    """A step before it changes the host (a toolkit installed first): the refusal was read from
    facts that may change, so the preview says so and goes on proposing the later steps."""
    deploy = tmp_path / "deploy.py"
    deploy.write_text(REFUSING_DEPLOY.replace(
        'check_card(name="Check the card", ok=False)',
        'write(name="Write the first file", path=FIRST)\n'
        'check_card(name="Check the card", ok=False)').replace(
        "FIRST", repr(str(tmp_path / "first"))).replace(
        "MARKER", repr(str(tmp_path / "marker"))))
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    result = subprocess.run([pyinfra, "@local", str(deploy), "--dry"], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "refused for now: @local: the card is not the profile's" in out
    table = out.split("--> Detected changes:", 1)[1]
    row = next(line for line in table.splitlines() if "Write the marker" in line)
    assert "@local" in row, row  # still proposed: the refusal may pass when the run executes
