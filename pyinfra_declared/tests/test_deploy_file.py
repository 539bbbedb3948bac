"""The deploy file known as a module file (pyinfra_declared/deploy_file.py): inspect's lookup of
its frames, which pyinfra's stack walk makes three times per operation, is a dictionary hit
(after inspect's first scan has seen it) instead of a scan of every loaded module each time; the
frame's file and line are what they were."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pyinfra_declared import deploy_file


def deploy_frame(path: Path):
    """A frame of `path` run as pyinfra's CLI runs a deploy file (compiled, exec'd)."""
    scope: dict = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope["frame"]


@pytest.fixture
def deploy(tmp_path: Path):
    path = tmp_path / "deploy.py"
    path.write_text("import inspect\n\nframe = inspect.currentframe()\n")
    yield path
    sys.modules.pop(deploy_file.PREFIX + str(path), None)


def lookups(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many objects inspect.getmodule looks at to place a frame of `path`."""
    frame, seen = deploy_frame(path), []
    real = inspect.ismodule
    monkeypatch.setattr(inspect, "ismodule", lambda obj: seen.append(obj) or real(obj))
    inspect.getmodule(frame, str(path))
    monkeypatch.setattr(inspect, "ismodule", real)
    return len(seen)


def test_a_registered_deploy_file_is_found_without_a_scan(
        deploy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = lookups(deploy, monkeypatch)
    assert before > 100, before  # every loaded module, looked at again on each lookup
    name = deploy_file.register(SimpleNamespace(current_deploy_filename=str(deploy)))
    lookups(deploy, monkeypatch)  # the one scan that learns every module's file, this one's too
    assert [lookups(deploy, monkeypatch) for _ in range(3)] == [1, 1, 1]
    frame = deploy_frame(deploy)
    assert inspect.getmodule(frame, str(deploy)) is sys.modules[name]
    info = inspect.getframeinfo(frame)
    assert (info.filename, info.lineno, info.code_context) == (
        str(deploy), 3, ["frame = inspect.currentframe()\n"])


def test_no_deploy_file_no_module() -> None:
    count = len(sys.modules)
    assert deploy_file.register(SimpleNamespace(current_deploy_filename=None)) is None
    assert len(sys.modules) == count
