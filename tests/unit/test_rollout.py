"""The rollout driver's plan (donorkit/rollout.py): batches of N in inventory order, never two
boxes of one public hostname together; the resume command names the failed box."""

from __future__ import annotations

import argparse

from donorkit.rollout import Box, plan_batches, resume_command

MODELS = {"qwen": {"checkpoint": "org/qwen"}, "hermes": {"checkpoint": "org/hermes"}}


def box(name: str, *hostnames: str) -> Box:
    return Box(name, {"models": MODELS,
                      "routes": [{"hostname": h, "model": "qwen"} for h in hostnames]})


def names(batches):
    return [[b.name for b in batch] for batch in batches]


def test_one_at_a_time_keeps_inventory_order():
    fleet = [box("a", "h1"), box("b", "h1"), box("c", "h2")]
    assert names(plan_batches(fleet, 1)) == [["a"], ["b"], ["c"]]


def test_boxes_of_one_hostname_never_share_a_batch():
    fleet = [box("a", "h1"), box("b", "h1"), box("c", "h2"), box("d", "h2", "h3"),
             box("e", "h3")]
    batches = plan_batches(fleet, 2)
    assert names(batches) == [["a", "c"], ["b", "d"], ["e"]]
    for batch in batches:
        hostnames = [h for b in batch for h in b.routes]
        assert len(hostnames) == len(set(hostnames))


def test_resume_command_names_the_failed_box(monkeypatch):
    monkeypatch.delenv("DONORS_FILE", raising=False)
    args = argparse.Namespace(batch=2, inventory="inventory/testbed.py")
    assert resume_command(args, box("tb-4090b", "h")) == \
        "make rollout FROM=tb-4090b BATCH=2 INVENTORY=inventory/testbed.py"
    monkeypatch.setenv("DONORS_FILE", "/tmp/my fleet.yml")
    args = argparse.Namespace(batch=None, inventory="inventory/gpus.py")
    assert resume_command(args, box("b", "h")) == \
        "DONORS_FILE='/tmp/my fleet.yml' make rollout FROM=b"
