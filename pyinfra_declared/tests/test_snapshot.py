"""The run's snapshot: one command for a host's declared facts, used only while the run has
changed nothing on that host; after that every read is a fresh remote command again. Run with
pyinfra's real State, Inventory and @local connector: the commands run in a real shell here."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.operations import server

from pyinfra_declared import snapshot
from pyinfra_declared.batched_facts import PathStates
from pyinfra_declared.decorator import operation
from pyinfra_declared.snapshot import Snapshot, host_changed, need


def run(command: str) -> list[str]:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    return result.stdout.splitlines()


def test_snapshot_keeps_each_command_output_and_status_apart() -> None:
    fact = Snapshot()
    commands = ["echo a; echo b", "echo lost >&2; false", "true", "cd /; echo x"]
    assert fact.process(run(fact.command(commands))) == [
        (0, ["a", "b"]), (1, []), (0, []), (0, ["x"])]


def test_snapshot_output_leaves_the_host_in_one_piece() -> None:
    # Line by line, every echo would cross the SSH link as its own packet.
    command = Snapshot().command(["echo a", "sleep 0.3; echo b"])
    with subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE) as shell:
        first = os.read(shell.stdout.fileno(), 1 << 16).decode()
        rest = shell.stdout.read().decode()
    assert "b" in first.splitlines() and rest == ""
    assert Snapshot().process((first + rest).splitlines()) == [(0, ["a"]), (0, ["b"])]


@pytest.fixture
def local() -> Iterator[tuple[State, object, list[str]]]:
    """A real pyinfra State over the @local host; the names of the facts it reads."""
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    [box] = list(inventory)
    reads: list[str] = []
    get_fact = box.get_fact

    def recorded(fact: type, *args: object, **kwargs: object) -> object:
        reads.append(fact.__name__)
        return get_fact(fact, *args, **kwargs)

    box.get_fact = recorded  # counts the reads; each is still pyinfra's own
    connect_all(state)
    yield state, box, reads


@operation(found=lambda op: need(PathStates, paths=[op.path]))
def present(path: str, found: dict):
    """A test operation: creates `path` (a directory) unless it exists."""
    if path not in found:
        yield f"mkdir {path}"


def test_host_changed_follows_pyinfra_operation_results(local, tmp_path: Path) -> None:
    state, box, _ = local
    add_op(state, present, path=str(tmp_path))  # exists: no command
    state.set_stage(StateStage.Prepare)
    assert host_changed(state, box) is False
    state.set_stage(StateStage.Execute)
    run_ops(state)
    assert host_changed(state, box) is False
    add_op(state, server.shell, commands=["true"])  # runs at once (the run is executing)
    assert host_changed(state, box) is True


def test_reads_come_from_one_snapshot_until_the_run_changes_the_host(local,
                                                                     tmp_path: Path) -> None:
    state, box, reads = local
    paths = [str(tmp_path / name) for name in ("a", "b", "c")]
    os.mkdir(paths[0])
    for path in paths:
        add_op(state, present, path=path)
    # Change detection (prepare stage) reads each operation's facts as pyinfra does.
    assert reads == ["PathStates"] * 3
    reads.clear()
    state.set_stage(StateStage.Execute)
    run_ops(state)
    # a: from the snapshot (one command for all three); b: from it too, then its mkdir ran;
    # c: read afresh (the host changed), so it sees b's... and makes c.
    assert reads == ["Snapshot", "PathStates"]
    assert all(Path(p).is_dir() for p in paths)


def test_stock_reads_when_switched_off(local, tmp_path: Path) -> None:
    state, _, reads = local
    add_op(state, present, path=str(tmp_path))
    reads.clear()
    snapshot.disable()
    try:
        state.set_stage(StateStage.Execute)
        run_ops(state)
    finally:
        snapshot.enable()
    assert reads == ["PathStates"]


def test_a_failed_section_is_read_again_on_its_own(local, tmp_path: Path) -> None:
    state, _, reads = local

    @operation(found=lambda op: need(PathStates, paths=[op.path]),
               broken=lambda op: need(Snapshot, commands=["exit 3"]))
    def checked(path: str, found: dict, broken: list):
        assert found == {}
        return None

    add_op(state, checked, path=str(tmp_path / "absent"))
    reads.clear()
    state.set_stage(StateStage.Execute)
    run_ops(state)
    # The snapshot's own section for the broken fact failed: that one is read again.
    assert reads == ["Snapshot", "Snapshot"]
