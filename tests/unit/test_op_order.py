"""pyinfra's operation order comes from caller line numbers; ours gets them without reading
source files, and the order is the same."""

from __future__ import annotations

import linecache
from types import SimpleNamespace

import pytest
from pyinfra.api import util as pyinfra_util

from donorkit import op_order


def order_from_here() -> list[int]:
    def deploy_code() -> list[int]:
        return pyinfra_util.get_operation_order_from_stack(
            SimpleNamespace(current_deploy_filename=None, current_op_file_number=0))

    return deploy_code()


def test_same_order_without_reading_source(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    original = linecache.getlines
    monkeypatch.setattr(linecache, "getlines",
                        lambda name, *a: reads.append(name) or original(name, *a))
    orders, source_reads = [], []
    try:
        for switch in (op_order.disable, op_order.enable):
            switch()
            reads.clear()
            orders.append(order_from_here())  # one call site, so the same stack
            source_reads.append(len(reads))
    finally:
        op_order.enable()
    assert orders[0] == orders[1]
    assert source_reads[0] > 0 and source_reads[1] == 0  # stock opens sources; ours doesn't
