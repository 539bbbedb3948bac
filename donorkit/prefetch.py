"""One round trip for a converged host's checks.

pyinfra reads each fact with its own remote command when the operation that needs it runs, and
keeps no fact cache; on a converged host every one of those reads is a round trip that finds
nothing to do. Our operations declare, when the deploy is loaded, which facts they will read
(`@reads`). At a host's first fact read the run takes a snapshot: every declared fact's own
command, run in one shell, each parsed by its own `process` (a fact with `batch_command` and
`batch_process` answers all its requests in one command, each value the same as its own read
would give). An operation gets its fact from that snapshot for as long as this run has changed
nothing on the host; from the first operation that ran a command there, every read is a fresh
remote command again (`read`). So a converged host is still checked in full, by the same
programs, at the start of the run; nothing is assumed. Operations must read their facts before
they yield their first command.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase
from pyinfra.context import ctx_host

Request = tuple[type[FactBase], dict[str, Any]]

_MARK = "@@uncloseai-snapshot"
_enabled = True
_declared: dict[str, dict[str, Request]] = {}  # host name -> {request key: request}
_snapshots: dict[str, dict[str, Any] | None] = {}  # host name -> {request key: value}


def request_key(fact: type[FactBase], kwargs: dict[str, Any]) -> str:
    return f"{fact.__name__}:{json.dumps(kwargs, sort_keys=True)}"


class Snapshot(FactBase):
    """Several facts' commands in one shell: each one's stdout and exit status, in order."""

    def command(self, commands: list[str]) -> str:
        sections = "; ".join(f"echo {_MARK}; ( {command} ) 2>/dev/null; echo {_MARK} $?"
                             for command in commands)
        # Written in one go: line by line, sshd sends each echo as its own packet, and the
        # controller decrypts and dispatches each one. On the testbed that was 97 packets and
        # 5.5 ms of controller CPU a snapshot; buffered, 8 packets and 1.1 ms.
        return f'snapshot=$( {sections} ); printf "%s\\n" "$snapshot"'

    def process(self, output: list[str]) -> list[tuple[int, list[str]]]:
        sections: list[tuple[int, list[str]]] = []
        lines: list[str] | None = None
        for line in output:
            if line == _MARK:
                lines = []
            elif line.startswith(f"{_MARK} ") and lines is not None:
                sections.append((int(line.split()[-1]), lines))
                lines = None
            elif lines is not None:
                lines.append(line)
        return sections

    def default(self) -> list:
        return []


def reads(requests: Callable[..., list[Request]]) -> Callable:
    """Wrap an @operation: when the deploy calls it (load time), note the facts it will read.
    `requests` gets the operation's keyword arguments."""

    def wrap(op: Callable) -> Callable:
        @functools.wraps(op)
        def call(*args: Any, **kwargs: Any) -> Any:
            declared = _declared.setdefault(host.name, {})
            for fact, fact_kwargs in requests(**kwargs):
                declared.setdefault(request_key(fact, fact_kwargs), (fact, fact_kwargs))
            return op(*args, **kwargs)

        return call

    return wrap


def read(fact: type[FactBase], **kwargs: Any) -> Any:
    """host.get_fact, answered from the run's snapshot while the run has changed nothing here."""
    snapshot = _current_snapshot()
    key = request_key(fact, kwargs)
    if snapshot is not None and key in snapshot:
        return snapshot[key]
    return host.get_fact(fact, **kwargs)


def read_request(request: Request) -> Any:
    """`read` of a (fact, kwargs) pair, as `@reads` declares them."""
    fact, kwargs = request
    return read(fact, **kwargs)


def _host_changed() -> bool:
    """Whether an operation of this run has executed a command on the current host."""
    return any(data.operation_meta.executed for data in host.state.ops[ctx_host.get()].values())


def enable() -> None:
    global _enabled
    _enabled = True


def disable() -> None:
    """Every fact read is its own remote command, as in stock pyinfra (for the benchmark)."""
    global _enabled
    _enabled = False


def _current_snapshot() -> dict[str, Any] | None:
    name = host.name
    if not _enabled or name not in _declared:
        return None
    if name in _snapshots and _snapshots[name] is None:
        return None  # this run changed the host: snapshots are over for it
    if _host_changed():
        _snapshots[name] = None
        return None
    if name not in _snapshots:
        _snapshots[name] = _take_snapshot(list(_declared[name].items()))
    return _snapshots[name]


def _take_snapshot(requests: list[tuple[str, Request]]) -> dict[str, Any]:
    sections = _sections(requests)
    outputs = host.get_fact(Snapshot, commands=[command for command, _ in sections])
    snapshot: dict[str, Any] = {}
    for (_, values), (status, lines) in zip(sections, outputs, strict=False):
        if status != 0:
            continue  # read again on its own when needed, so pyinfra reports the failure
        try:
            snapshot.update(values(lines))
        except Exception:  # noqa: BLE001 - the same: a fresh read reports it pyinfra's way
            continue
    return snapshot


Section = tuple[str, Callable[[list[str]], dict[str, Any]]]  # command, output -> {key: value}


def _sections(requests: list[tuple[str, Request]]) -> list[Section]:
    """One section per request, except that the requests of a fact with `batch_command` share
    one (PathStates: one stat for every path; UnitState: one systemctl for every unit)."""
    by_fact: dict[type[FactBase], list[tuple[str, dict[str, Any]]]] = {}
    for key, (fact, kwargs) in requests:
        by_fact.setdefault(fact, []).append((key, kwargs))
    sections: list[Section] = []
    for fact, group in by_fact.items():
        if hasattr(fact, "batch_command") and len(group) > 1:
            sections.append(_batched_section(fact, group))
        else:
            sections.extend(_single_section(fact, key, kwargs) for key, kwargs in group)
    return sections


def _single_section(fact: type[FactBase], key: str, kwargs: dict[str, Any]) -> Section:
    def values(lines: list[str]) -> dict[str, Any]:
        # As pyinfra does: no output means the fact's default.
        return {key: fact().process(lines) if lines else fact().default()}

    return fact().command(**kwargs), values


def _batched_section(fact: type[FactBase], group: list[tuple[str, dict[str, Any]]]) -> Section:
    keys, kwargs_list = [key for key, _ in group], [kwargs for _, kwargs in group]

    def values(lines: list[str]) -> dict[str, Any]:
        return dict(zip(keys, fact().batch_process(lines, kwargs_list), strict=True))

    return fact().batch_command(kwargs_list), values
