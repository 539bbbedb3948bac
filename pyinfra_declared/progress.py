"""Long steps say so while they run: a pyinfra state callback (its public
`State.add_callback_handler`) that, for each host, logs the step's name and how long it has run
every `interval` seconds while an operation runs there, and how long it took when it ends after
more than `report_after` seconds. Lines go through pyinfra's own host log (`[host] ...` at INFO),
so they show at the default verbosity, between pyinfra's own "Starting operation" and
"Success" lines:

    --> Starting operation: Install the vLLM venv
        [tb-4090] running: Install the vLLM venv (30 s)
        [tb-4090] running: Install the vLLM venv (60 s)
        [tb-4090] took 71.4 s: Install the vLLM venv
        [tb-4090] Success

Nothing about donor boxes: any deploy may register it (`register(state)`, once per run)."""

from __future__ import annotations

import time

import gevent
from pyinfra import logger
from pyinfra.api.state import BaseStateCallback


class StepProgress(BaseStateCallback):
    """The callback. Static methods in pyinfra's base; ours keep per-run state on the instance."""

    def __init__(self, interval: float = 30.0, report_after: float = 10.0) -> None:
        self.interval, self.report_after = interval, report_after
        self._running: dict[tuple[str, str], tuple[float, gevent.Greenlet]] = {}

    @staticmethod
    def _name(state, op_hash: str) -> str:
        names = state.get_op_meta(op_hash).names
        return ", ".join(sorted(names)) or "operation"

    def operation_host_start(self, state, host, op_hash) -> None:  # type: ignore[override]
        began = time.monotonic()
        name = self._name(state, op_hash)

        def tick() -> None:
            while True:
                gevent.sleep(self.interval)
                host.log(f"running: {name} ({time.monotonic() - began:.0f} s)", logger.info)

        self._running[(host.name, op_hash)] = (began, gevent.spawn(tick))

    def _end(self, state, host, op_hash) -> None:
        began, ticker = self._running.pop((host.name, op_hash), (None, None))
        if ticker is not None:
            ticker.kill(block=False)
        if began is not None:
            took = time.monotonic() - began
            if took >= self.report_after:
                host.log(f"took {took:.1f} s: {self._name(state, op_hash)}", logger.info)

    def operation_host_success(self, state, host, op_hash,  # type: ignore[override]
                               retry_count: int = 0) -> None:
        self._end(state, host, op_hash)

    def operation_host_error(self, state, host, op_hash, *args, **kwargs) -> None:  # type: ignore[override]  # noqa: E501
        self._end(state, host, op_hash)


def register(state, interval: float = 30.0, report_after: float = 10.0) -> StepProgress:
    """Add the callback to this run's state once (a deploy file runs once per host)."""
    for handler in state.callback_handlers:
        if isinstance(handler, StepProgress):
            return handler
    handler = StepProgress(interval, report_after)
    state.add_callback_handler(handler)
    return handler
