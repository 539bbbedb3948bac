"""The run's snapshot: one command for a host's declared facts, used only while the run has
changed nothing on that host; after that every read is a fresh remote command again."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

from pyinfra.context import ctx_host

from donorkit import prefetch
from donorkit.facts import PathStates, UnitState
from donorkit.prefetch import Snapshot


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


class FakeHost:
    """A host of a running deploy: its executed operations and every remote fact read."""

    def __init__(self, name: str, snapshot_output: list[str]) -> None:
        self.name = name
        self.snapshot_output = snapshot_output
        self.reads: list[str] = []
        self.state = SimpleNamespace(ops={self: {}})

    def get_fact(self, fact: type, **kwargs: object) -> object:
        self.reads.append(fact.__name__)
        if fact is Snapshot:
            return Snapshot().process(self.snapshot_output)
        return {"fresh": True}

    def run_operation(self, changed: bool) -> None:
        meta = SimpleNamespace(executed=changed)
        self.state.ops[self][f"op{len(self.state.ops[self])}"] = SimpleNamespace(
            operation_meta=meta)


def declare(paths: list[str], unit: str) -> None:
    """What an operation decorated with @reads does when the deploy calls it."""
    prefetch.reads(lambda **_: [(PathStates, {"paths": paths}),
                                (UnitState, {"unit": unit})])(lambda **_: None)()


def test_reads_come_from_one_snapshot_until_the_run_changes_the_host() -> None:
    mark = "@@uncloseai-snapshot"
    output = [mark, "directory|root|root|755|/opt/u", f"{mark} 0",
              mark, "ActiveState=active", f"{mark} 0"]
    box = FakeHost("snapshot-box", output)
    with ctx_host.use(box):
        declare(["/opt/u"], "caddy")
        box.run_operation(changed=False)
        assert prefetch.read(PathStates, paths=["/opt/u"]) == {
            "/opt/u": {"type": "directory", "user": "root", "group": "root", "mode": "755"}}
        assert prefetch.read(UnitState, unit="caddy") == {"ActiveState": "active"}
        assert box.reads == ["Snapshot"]
        # Not declared: read on its own.
        assert prefetch.read(PathStates, paths=["/etc"]) == {"fresh": True}
        # An operation ran a command here: what the snapshot says may be stale now.
        box.run_operation(changed=True)
        assert prefetch.read(PathStates, paths=["/opt/u"]) == {"fresh": True}
        assert box.reads == ["Snapshot", "PathStates", "PathStates"]


def test_a_failed_or_missing_section_is_read_again_on_its_own() -> None:
    mark = "@@uncloseai-snapshot"
    box = FakeHost("failing-box", [mark, f"{mark} 1"])  # second section never printed
    with ctx_host.use(box):
        declare(["/opt/v"], "vllm-qwen.service")
        assert prefetch.read(PathStates, paths=["/opt/v"]) == {"fresh": True}
        assert prefetch.read(UnitState, unit="vllm-qwen.service") == {"fresh": True}
        assert box.reads == ["Snapshot", "PathStates", "UnitState"]


def test_a_host_without_declarations_reads_as_pyinfra_does() -> None:
    box = FakeHost("plain-box", [])
    with ctx_host.use(box):
        assert prefetch.read(PathStates, paths=["/x"]) == {"fresh": True}
    assert box.reads == ["PathStates"]


def test_requests_of_a_batched_fact_share_one_section() -> None:
    """Two operations' PathStates in one stat: one section, each answered with its own paths;
    if that section fails, each is read again on its own."""
    mark = "@@uncloseai-snapshot"
    stat = ["directory|root|root|755|/opt/a", "regular file|fox|fox|644|/opt/b"]
    box = FakeHost("batching-box", [mark, *stat, f"{mark} 0"])
    with ctx_host.use(box):
        prefetch.reads(lambda **_: [(PathStates, {"paths": ["/opt/a"]}),
                                    (PathStates, {"paths": ["/opt/b", "/opt/c"]})])(
            lambda **_: None)()
        sections = prefetch._sections(list(prefetch._declared["batching-box"].items()))
        assert len(sections) == 1
        command = sections[0][0]
        assert command.count("stat ") == 1 and "/opt/a" in command and "/opt/c" in command
        assert prefetch.read(PathStates, paths=["/opt/b", "/opt/c"]) == {
            "/opt/b": {"type": "regular file", "user": "fox", "group": "fox", "mode": "644"}}
        assert prefetch.read(PathStates, paths=["/opt/a"])["/opt/a"]["type"] == "directory"
        assert box.reads == ["Snapshot"]
    failing = FakeHost("failing-batch-box", [mark, f"{mark} 2"])
    with ctx_host.use(failing):
        prefetch.reads(lambda **_: [(PathStates, {"paths": ["/opt/a"]}),
                                    (PathStates, {"paths": ["/opt/b"]})])(lambda **_: None)()
        assert prefetch.read(PathStates, paths=["/opt/a"]) == {"fresh": True}
        assert prefetch.read(PathStates, paths=["/opt/b"]) == {"fresh": True}
        assert failing.reads == ["Snapshot", "PathStates", "PathStates"]
