"""Our custom operations, pyinfra's own way (tests/operations/<module>.<op>/*.json upstream):
an operation's arguments and the facts it reads go in, the exact commands come out, and a
converged host yields no command at all (that is what makes a re-run report zero changes).

Cases live in tests/unit/operations/<operation>/<case>.json:
  {"args": {...}, "facts": {"FactName": {"k=v,k2=v2": value}}, "commands": [...],
   "noop": bool, "error": "substring"?, "changed_dependencies": bool?}
Uploads show as "upload <dest>" (" via <remote_temp_filename>" when one is given)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host

from donorkit import operations

CASES = sorted((Path(__file__).parent / "operations").glob("*/*.json"))


class FakeOperation:
    """Stands in for an earlier operation's OperationMeta (did it change anything?)."""

    def __init__(self, changed: bool) -> None:
        self.changed = changed

    def did_change(self) -> bool:
        return self.changed


class FakeHost:
    """A host whose facts are the case's; records noop messages."""

    name = "box-a"
    data = {"ssh_user": "ubuntu"}  # a sudo login: uploads go through remote_temp_filename

    def __init__(self, facts: dict) -> None:
        self.facts = facts
        self.noops: list[str] = []

    def get_fact(self, fact: type, **kwargs: object) -> object:
        key = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items())
                       if not isinstance(v, list)) or "-"
        by_args = self.facts.get(fact.__name__, {})
        if key not in by_args:
            raise AssertionError(f"case lacks fact {fact.__name__}[{key!r}]")
        return by_args[key]

    def noop(self, message: str) -> None:
        self.noops.append(message)


def as_text(command: object) -> str:
    if isinstance(command, FileUploadCommand):
        via = f" via {command.remote_temp_filename}" if command.remote_temp_filename else ""
        return f"upload {command.dest}{via}"
    if isinstance(command, StringCommand):
        text = command.get_raw_value()
    else:
        text = str(command)
    # apt commands carry files/apt_get.sh's shell function (tested on its own in a real shell).
    return text.replace(operations.APT_FUNCTIONS, "<files/apt_get.sh>")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.stem}" for c in CASES])
def test_operation(case: Path) -> None:
    spec = json.loads(case.read_text())
    operation = getattr(operations, case.parent.name)
    args = dict(spec["args"])
    for key in ("restart_when", "reinstall"):
        if key in args:
            args[key] = [FakeOperation(changed) for changed in args[key]]
    fake = FakeHost(spec.get("facts", {}))
    with ctx_host.use(fake):
        commands = [as_text(c) for c in operation._inner(**args)]
    if "error" in spec:
        # A refusal is a command that fails with the message, so only this host stops.
        assert commands[-1].endswith(" >&2; exit 1"), commands
        message = shlex.split(commands[-1].removesuffix(" >&2; exit 1"))[1]
        assert message.startswith("uncloseai: box-a: "), message
        assert re.search(spec["error"], message), message
        return
    assert commands == spec["commands"]
    assert bool(fake.noops) == spec["noop"], fake.noops
