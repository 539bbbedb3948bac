"""pyinfra's per-operation work, made smaller: the operation order comes from caller line
numbers, found without reading source files (the order is the same), and the global arguments'
types are evaluated once (the answer is the same)."""

from __future__ import annotations

import linecache
from types import SimpleNamespace

import pytest
from pyinfra.api import arguments as pyinfra_arguments
from pyinfra.api import util as pyinfra_util

from donorkit import op_overhead


def order_from_here() -> tuple[list[int], list[int], str]:
    """The op order pyinfra computes here, without and with a deploy file (this one) on the
    stack, and the call location it reports."""
    def deploy_code() -> tuple[list[int], list[int], str]:
        return (pyinfra_util.get_operation_order_from_stack(
                    SimpleNamespace(current_deploy_filename=None, current_op_file_number=0)),
                pyinfra_util.get_operation_order_from_stack(
                    SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=3)),
                pyinfra_util.get_call_location())

    return deploy_code()


def test_same_order_without_reading_source(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    original = linecache.getlines
    monkeypatch.setattr(linecache, "getlines",
                        lambda name, *a: reads.append(name) or original(name, *a))
    orders, source_reads = [], []
    try:
        for switch in (op_overhead.disable, op_overhead.enable):
            switch()
            reads.clear()
            orders.append(order_from_here())  # one call site, so the same stack
            source_reads.append(len(reads))
    finally:
        op_overhead.enable()
    assert orders[0] == orders[1]
    assert source_reads[0] > 0 and source_reads[1] == 0  # stock opens sources; ours doesn't


def test_global_argument_types_evaluated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    op_overhead.disable()
    try:
        stock = pyinfra_arguments.all_global_arguments()
        op_overhead.enable()
        calls: list[object] = []
        original = pyinfra_arguments.get_type_hints
        monkeypatch.setattr(pyinfra_arguments, "get_type_hints",
                            lambda *a, **k: calls.append(a) or original(*a, **k))
        assert pyinfra_arguments.all_global_arguments() == stock
        assert pyinfra_arguments.all_global_arguments() == stock
        assert len(calls) <= 1  # kept after the first call in this process
    finally:
        op_overhead.enable()
