"""Long steps say so while they run (pyinfra_declared/progress.py), with pyinfra's real State,
@local connector and operations: a real `sleep` runs while the callback logs."""

from __future__ import annotations

import logging

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.operations import server

from pyinfra_declared.progress import StepProgress, register


def _run(commands: dict[str, str], caplog) -> list[str]:
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    handler = register(state, interval=0.4, report_after=0.7)
    assert register(state) is handler  # once per run, however often a deploy file registers it
    assert sum(isinstance(h, StepProgress) for h in state.callback_handlers) == 1
    connect_all(state)
    for name, command in commands.items():
        add_op(state, server.shell, name=name, commands=[command])
    state.set_stage(StateStage.Execute)
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        try:
            run_ops(state)
        except PyinfraError:  # the only host failed: pyinfra stops the run
            pass
    return [r.getMessage() for r in caplog.records]


def test_a_long_step_is_named_while_it_runs_and_timed_when_it_ends(caplog) -> None:
    lines = _run({"Sleep a while": "sleep 1.5", "Quick": "true"}, caplog)
    running = [line for line in lines if "running: Sleep a while (" in line]
    assert 2 <= len(running) <= 4, lines
    took = [line for line in lines if "took " in line]
    assert len(took) == 1 and "Sleep a while" in took[0], lines
    seconds = float(took[0].split("took ")[1].split(" s")[0])
    assert 1.4 <= seconds < 5, took
    # A short step is not reported, and no ticker outlives its step.
    assert not any("Quick" in line and ("running:" in line or "took" in line) for line in lines)


def test_a_failed_step_stops_its_ticker(caplog) -> None:
    lines = _run({"Fail late": "sleep 0.9; false"}, caplog)
    assert any("took " in line and "Fail late" in line for line in lines), lines
    count = sum("running: Fail late" in line for line in lines)
    assert 1 <= count <= 3, lines
