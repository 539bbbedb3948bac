"""Testing operations pyinfra's way (its tests/operations/<module>.<op>/*.json): arguments and
fact values in, the exact commands out, and whether the host needed nothing (a noop).

A case file: {"args": {...}, "facts": {"<body parameter>": value}, "commands": [...],
"noop": bool} or, for a refusal, {"args", "facts", "error": "<regex of the message>"}.
Uploads and downloads read as "upload <dest>" (" via <remote_temp_filename>" when one is given)
and their repr; apt_get.sh's shell function as "<apt_get.sh>"."""

from __future__ import annotations

import json
import re
import shlex
import typing
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host


class CaseHost:
    """Stands in for pyinfra's Host in a case (no host exists in one): a name, and the noop
    messages an operation logs."""

    name = "box-a"
    data = {"ssh_user": "ubuntu"}  # a sudo login: uploads go through remote_temp_filename

    def __init__(self) -> None:
        self.noops: list[str] = []

    def noop(self, message: str) -> None:
        self.noops.append(message)


def as_text(command: object) -> str:
    if isinstance(command, FileUploadCommand):
        via = f" via {command.remote_temp_filename}" if command.remote_temp_filename else ""
        return f"upload {command.dest}{via}"
    text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
    # apt commands carry apt_get.sh's shell function (tested on its own in a real shell).
    from pyinfra_declared.apt import APT_FUNCTIONS

    return text.replace(APT_FUNCTIONS, "<apt_get.sh>")


def plan(op: Any, args: dict, facts: dict) -> tuple[list[str], list[str]]:
    """(commands as text, noop messages) of `op` for these arguments and fact values. The case
    must give exactly the facts the operation declares for these arguments."""
    declared = {name for name, request in op.requests(**args).items() if request is not None}
    assert declared == {name for name, value in facts.items()
                        if value is not None or name in declared}, (declared, sorted(facts))
    values = {name: facts.get(name) for name in op.requests(**args)}
    fake = CaseHost()
    with ctx_host.use(fake):
        commands = [as_text(c) for c in op.plan(**args, **values)]
    return commands, fake.noops


def refusal_message(commands: list[str]) -> str:
    """The message of a refusal command (the last one), or fail the test."""
    assert commands and commands[-1].endswith(" >&2; exit 1"), commands
    message = shlex.split(commands[-1].removesuffix(" >&2; exit 1"))[1]
    assert message.startswith(f"refused: {CaseHost.name}: "), message
    return message


def typed_args(op: Any, args: dict) -> dict:
    """The case's JSON arguments as the operation's signature types them (a typed model from
    its JSON mapping, as pydantic reads it); the rest as given."""
    hints = typing.get_type_hints(op.body, include_extras=True)
    return {name: TypeAdapter(hints[name]).validate_python(value) if name in hints else value
            for name, value in args.items()}


def check_case(op: Any, case: Path) -> None:
    spec = json.loads(case.read_text())
    commands, noops = plan(op, typed_args(op, spec["args"]), spec.get("facts", {}))
    if "error" in spec:
        assert re.search(spec["error"], refusal_message(commands)), commands
        return
    assert commands == spec["commands"]
    assert bool(noops) == spec["noop"], noops
