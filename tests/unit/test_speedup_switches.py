"""The switches the benchmark uses to run the same deploy with our speed-ups off."""

from __future__ import annotations

import pytest

from donorkit.inventory import SPEEDUPS, stock_behaviour


def test_nothing_is_stock_by_default() -> None:
    assert stock_behaviour({}) == set()


def test_all_a_list_and_the_older_ssh_switch() -> None:
    assert stock_behaviour({"UNCLOSEAI_STOCK": "all"}) == set(SPEEDUPS)
    assert stock_behaviour({"UNCLOSEAI_STOCK": "snapshot, op_overhead"}) == {"snapshot",
                                                                           "op_overhead"}
    assert stock_behaviour({"UNCLOSEAI_STOCK_SSH": "1"}) == {"ssh"}


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown snapshots"):
        stock_behaviour({"UNCLOSEAI_STOCK": "snapshots"})
