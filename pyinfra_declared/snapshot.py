"""One round trip for a host's checks while the run has changed nothing on it.

pyinfra reads each fact with its own remote command and keeps no fact cache; on a host that
needs nothing, every one of those reads is a round trip that finds nothing to do. Operations
made with `pyinfra_declared.decorator` declare the facts they need when the deploy calls them
(load time). When the run executes, the first fact read on a host takes a snapshot: every
declared fact's own command, run in one shell, each parsed by its own `process` (a fact with
`batch_command` and `batch_process` answers all its requests in one program, each value the same
as its own read would give). Operations get their facts from that snapshot for as long as this run
has changed nothing on the host; from the first operation that ran a command there, every read is
a fresh remote command again. Change detection (pyinfra's prepare stage, before the prompt, and
`--dry`) reads each operation's facts as pyinfra does: the later operations are not declared yet
while the first one is checked.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host

Request = tuple[type[FactBase], dict[str, Any]]

_MARK = "@@pyinfra-snapshot"
_enabled = True
# Per host (pyinfra's Host objects; several States in one process keep theirs apart).
_declared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host -> {key: Request}
_snapshots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host -> {key: value}|None


def need(fact: type[FactBase], **kwargs: Any) -> Request:
    """A fact an operation needs, with its arguments: what an operation's fact lambdas return."""
    return fact, kwargs


def request_key(request: Request) -> str:
    fact, kwargs = request
    return f"{fact.__module__}.{fact.__name__}:{json.dumps(kwargs, sort_keys=True)}"


class Snapshot(FactBase):
    """Several facts' commands in one shell: each one's stdout and exit status, in order."""

    def command(self, commands: list[str]) -> str:
        sections = "; ".join(f"echo {_MARK}; ( {command} ) 2>/dev/null; echo {_MARK} $?"
                             for command in commands)
        # Written in one go: line by line, sshd sends each echo as its own packet, and the
        # controller decrypts and dispatches each one (97 packets and 5.5 ms of controller CPU
        # a snapshot on the testbed; buffered, 8 packets and 1.1 ms).
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


def declare(requests: list[Request]) -> None:
    """Note, for the current host, facts an operation of this run will read."""
    declared = _host_declared()
    for request in requests:
        declared.setdefault(request_key(request), request)


def _host_declared() -> dict[str, Request]:
    current = _current_host()
    if current not in _declared:
        _declared[current] = {}
    return _declared[current]


def _current_host() -> Any:
    return ctx_host.get()


def value(request: Request) -> Any:
    """The fact's value: from the host's snapshot while the run has changed nothing there,
    else pyinfra's own read (host.get_fact)."""
    snapshot = _current_snapshot()
    key = request_key(request)
    if snapshot is not None and key in snapshot:
        return snapshot[key]
    fact, kwargs = request
    return host.get_fact(fact, **kwargs)


def host_changed(run_state: Any, run_host: Any) -> bool:
    """Whether an operation of this run has run a command on `run_host`.

    pyinfra has no call for this. It is answered from each operation's OperationMeta, which
    pyinfra gives deploys as an operation's result (is_complete, did_change, did_error are its
    public methods), found through State.get_op_data_for_host. The one place that knows how;
    pyinfra_declared/tests/test_snapshot.py (test_host_changed_follows_pyinfra_operation_results)
    checks it against a real State and real operations."""
    for op_hash in run_host.op_hash_order:
        meta = run_state.get_op_data_for_host(run_host, op_hash).operation_meta
        if meta.is_complete() and (meta.did_change() or meta.did_error()):
            return True
    return False


def enable() -> None:
    global _enabled
    _enabled = True


def disable() -> None:
    """Every fact read is its own remote command, as in stock pyinfra (the benchmark's stock
    comparison switches this off from its own inventory)."""
    global _enabled
    _enabled = False


def _current_snapshot() -> dict[str, Any] | None:
    current = _current_host()
    # The host's own State: pyinfra's `state` context is not set in the greenlets that
    # execute operations.
    run_state = current.state
    if not _enabled or current not in _declared or run_state.current_stage != StateStage.Execute:
        return None
    if current in _snapshots and _snapshots[current] is None:
        return None  # this run changed the host: snapshots are over for it
    if host_changed(run_state, current):
        _snapshots[current] = None
        return None
    if current not in _snapshots:
        _snapshots[current] = _take_snapshot(list(_declared[current].items()))
    return _snapshots[current]


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


def _sections(requests: list[tuple[str, Request]]) -> list[tuple[str, Any]]:
    """One section per request, except that the requests of a fact with `batch_command` share
    one (e.g. one stat for every path, one systemctl for every unit)."""
    by_fact: dict[type[FactBase], list[tuple[str, dict[str, Any]]]] = {}
    for key, (fact, kwargs) in requests:
        by_fact.setdefault(fact, []).append((key, kwargs))
    sections: list[tuple[str, Any]] = []
    for fact, group in by_fact.items():
        if hasattr(fact, "batch_command") and len(group) > 1:
            sections.append(_batched_section(fact, group))
        else:
            sections.extend(_single_section(fact, key, kwargs) for key, kwargs in group)
    return sections


def _single_section(fact: type[FactBase], key: str, kwargs: dict[str, Any]) -> tuple[str, Any]:
    def values(lines: list[str]) -> dict[str, Any]:
        # As pyinfra does: no output means the fact's default.
        return {key: fact().process(lines) if lines else fact().default()}

    return _text(fact().command(**kwargs)), values


def _batched_section(fact: type[FactBase],
                     group: list[tuple[str, dict[str, Any]]]) -> tuple[str, Any]:
    keys, kwargs_list = [key for key, _ in group], [kwargs for _, kwargs in group]

    def values(lines: list[str]) -> dict[str, Any]:
        return dict(zip(keys, fact().batch_process(lines, kwargs_list), strict=True))

    return _text(fact().batch_command(kwargs_list)), values


def _text(command: Any) -> str:
    """A fact's command as shell text (pyinfra's own facts may give a StringCommand)."""
    return command if isinstance(command, str) else command.get_raw_value()
