"""An operation is its arguments and the facts it needs, in; commands, out.

    @operation(installed=lambda op: need(DebStatus, packages=op.packages))
    def apt_install(packages: list[str], installed: set[str]):
        missing = [p for p in packages if p not in installed]
        if not missing:
            host.noop("all installed")
            return
        yield f"apt-get install -y {' '.join(map(shlex.quote, missing))}"

Each keyword of `operation` names a parameter of the body that receives a fact's value; its
lambda gets the operation's arguments (`op.packages`) and returns the fact and its arguments
(`need(...)`), or None when that fact is not needed for these arguments. The facts are declared
once, when the deploy calls the operation, and read by pyinfra_declared.snapshot: from the
host's snapshot while the run has changed nothing there, a fresh read after. The body reads no
fact itself. A body that only checks (no command ever) is a plain function: no `yield` needed.
`fail(message)` refuses the host. When the run executes, the operation's command becomes one
that prints the message and fails, so pyinfra stops this host and carries on with the others (an
exception inside an operation would abort the whole run, every host). In change detection (the
plain command's preview, `--dry`) a refusal is not a change: it is said as one line, `refused:
HOST: reason`, and that host proposes nothing after it (it stops there when the run executes).
Where an earlier operation of the run proposed a change on that host, the facts the refusal was
read from may change before the step runs (a toolkit installed first): it is said as `refused
for now`, and the preview goes on. A refusal after a command the body already yielded shows as
that command's change.

The result is a pyinfra operation: global arguments (`name=`, `_if=`, `_sudo=`...) work as on
pyinfra's own, in change detection, `--dry`, `--diff` and the run alike.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable, Iterable, Iterator
from inspect import signature
from types import SimpleNamespace
from typing import Any, NoReturn

import click
from pyinfra import host, logger, state
from pyinfra.api import operation as pyinfra_operation

from pyinfra_declared import snapshot
from pyinfra_declared.snapshot import Request

FactLambda = Callable[[SimpleNamespace], "Request | None"]


class Refusal(Exception):
    """Raised by `fail` inside an operation body: this host must not go on."""


def fail(message: str) -> NoReturn:
    raise Refusal(f"{host.name}: {message}")


def refusal_command(refusal: Refusal) -> str:
    return f"echo {shlex.quote(f'refused: {refusal}')} >&2; exit 1"


# Hosts refused during this process's change detection: they propose nothing after it. Hosts on
# which an operation of this run already proposed a command: a refusal there is read from facts
# that step may change (a toolkit not installed yet), so it is said, not final.
_refused_in_preview: set[str] = set()
_changing_in_preview: set[str] = set()


def _previewing() -> bool:
    """pyinfra is detecting changes (the plain command's first pass, `--dry`), not executing."""
    return state.should_check_for_changes() and not state.is_executing


def _say_refused(refusal: Refusal) -> None:
    if host.name in _changing_in_preview:
        logger.warning(click.style(f"refused for now: {refusal}", "yellow")
                       + " (preview: an earlier step of this run changes the host; this step "
                       "checks again when the run executes)")
        return
    _refused_in_preview.add(host.name)
    logger.error(click.style(f"refused: {refusal}", "red")
                 + " (preview: this host stops at this step when the run executes)")


def operation(**facts: FactLambda) -> Callable[[Callable], Any]:
    """Make `body(args..., fact values...)` a pyinfra operation taking only `args...`."""

    def decorate(body: Callable) -> Any:
        body_signature = signature(body)
        unknown = set(facts) - set(body_signature.parameters)
        if unknown:
            raise TypeError(f"{body.__name__}: no parameter for the facts {sorted(unknown)}")
        op_signature = body_signature.replace(parameters=[
            p for name, p in body_signature.parameters.items() if name not in facts])

        def requests(args: tuple, kwargs: dict[str, Any]) -> dict[str, Request | None]:
            bound = op_signature.bind(*args, **kwargs)
            bound.apply_defaults()
            op = SimpleNamespace(**bound.arguments)
            return {name: declared(op) for name, declared in facts.items()}

        def commands(*args: Any, **kwargs: Any) -> Iterator:
            """What pyinfra runs in change detection and again in the run."""
            previewing = _previewing()
            if previewing and host.name in _refused_in_preview:
                return
            values = {name: None if request is None else snapshot.value(request)
                      for name, request in requests(args, kwargs).items()}
            try:
                for command in _as_commands(body(*args, **kwargs, **values)):
                    if previewing:
                        _changing_in_preview.add(host.name)
                    yield command
            except Refusal as refusal:
                if previewing:
                    _say_refused(refusal)
                else:
                    yield refusal_command(refusal)

        functools.update_wrapper(commands, body)
        commands.__signature__ = op_signature  # pyinfra checks the call's arguments against it
        pyinfra_op = pyinfra_operation()(commands)

        @functools.wraps(body)
        def call(*args: Any, **kwargs: Any) -> Any:
            own = {key: value for key, value in kwargs.items()
                   if key in op_signature.parameters}
            snapshot.declare([r for r in requests(args, own).values() if r is not None])
            return pyinfra_op(*args, **kwargs)

        call.__signature__ = op_signature
        call._inner = pyinfra_op._inner
        call.body = body
        call.requests = lambda **args: requests((), args)
        call.plan = functools.partial(plan, body)
        return call

    return decorate


def plan(body: Callable, **args_and_facts: Any) -> list:
    """The commands `body` gives for these arguments and fact values, refusals included, as
    pyinfra would run them (no host, no pyinfra run: for tests)."""
    commands: list = []
    try:
        commands.extend(_as_commands(body(**args_and_facts)))
    except Refusal as refusal:
        commands.append(refusal_command(refusal))
    return commands


def _as_commands(result: Iterable | None) -> Iterator:
    if result is not None:
        yield from result
