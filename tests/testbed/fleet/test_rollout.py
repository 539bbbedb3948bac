"""Rollout: a change reaches the fleet without the hostname going down. The readiness gate holds
a deploy until the restarted model is listed; a rollout whose change makes a box fail at start
stops there, says how to resume, and refuses to take the last serving box down; the fix resumed,
a rolling rollout under a request loop through the edge loses no request, one box at a time, a
second rollout meanwhile refused. The `fleet_data_back` fixture deploys the fleet's own data
again after the scenario (the rollouts leave their variant's)."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from donorkit.commands.transport import wait_until
from donorkit.inventory.fleet import load_fleet
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.converged import Fleet
from tests.testbed.fleet.helpers import (
    EDGE,
    GOOD,
    HOSTNAME,
    LOAD_DELAY,
    PKI,
    SECOND,
    TIMES,
    both_donors_in_the_pool,
    deploy,
    donors_variant,
    hub,
    loop_seqs,
    rollout,
)

pytestmark = pytest.mark.usefixtures("fleet_data_back")


@pytest.fixture(scope="module")
def fleet_data_back(fleet: Fleet) -> Iterator[None]:
    """After the scenario, tb-4090 and tb-4090b (and the edge) deployed from the fleet's own
    donors file again, serving in the edge's pool."""
    yield
    hosts = fleet.hosts
    rc, _, log, took = deploy("--limit", GOOD, "--limit", SECOND, "--limit", EDGE)
    TIMES["fleet data back after the rollouts"] = took
    assert rc == 0, log[-4000:]
    both_donors_in_the_pool(hosts)


def test_ready_gate_waits_for_the_model_to_load(hosts: dict[str, Host]) -> None:
    """A restart left due (a recorded digest that no longer matches): the deploy restarts the
    unit and waits until /v1/models lists the model (the stand-in lists it after its load
    delay, testbed data), showing the elapsed time."""
    good = hosts[GOOD]
    ssh(good, "echo stale > /opt/uncloseai/state/vllm-qwen.service.started")
    rc, report, log, _ = deploy("--limit", GOOD)
    assert rc == 0, log[-4000:]
    ready = re.search(r"ready gate: vllm-qwen.service ready after ([\d.]+) s", log)
    assert ready, log[-4000:]
    # The gate starts a moment after the unit: it waited most of the load delay.
    assert float(ready.group(1)) >= LOAD_DELAY / 2, ready.group(0)
    # This start's journal (its invocation): the gate's warm-up requests log after the load.
    loaded = ssh(good, "journalctl -o cat _SYSTEMD_INVOCATION_ID=$(systemctl show -p InvocationID "
                       "--value vllm-qwen.service) | grep 'loaded after'").stdout
    assert float(re.findall(r"loaded after ([\d.]+) s", loaded)[-1]) >= LOAD_DELAY, loaded


def test_rollout_stops_at_a_box_that_fails_at_start(hosts: dict[str, Host],
                                                    tmp_path: Path) -> None:
    """A rollout whose change makes tb-4090b's vLLM refuse a flag: tb-4090 is done, tb-4090b
    fails with the stand-in's refusal from the journal, the driver prints the resume command;
    a rollout that would then take tb-4090 down while tb-4090b is not serving refuses."""
    # The qwen profile's args with one bad value (the rest as the schema wants a hybrid's).
    bad_args = ["--max-num-seqs", "12", "--kv-cache-dtype", "fp9", "--dtype", "float16",
                "--enable-prefix-caching", "--mamba-cache-mode", "align", "--block-size", "1600"]
    hub("reset", {})
    variant = donors_variant(tmp_path, [GOOD, SECOND],
                             {"environment": {"VLLM_STANDIN_LOAD_DELAY": str(LOAD_DELAY + 1)}})
    doc = yaml.safe_load(variant.read_text())
    doc["donors"][SECOND]["overrides"] = {"models": {"qwen": {"args": bad_args}}}
    variant.write_text(yaml.safe_dump(doc, sort_keys=False))
    rc, out, took = rollout(variant)
    TIMES["rollout failing at the 2nd box"] = took
    assert rc == 1, out[-4000:]
    assert "did not become ready" in out and "invalid choice: 'fp9'" in out, out[-4000:]
    assert re.search(rf"done: +{GOOD} \(", out), out[-3000:]
    assert re.search(rf"failed: +{SECOND}: pyinfra exited", out), out[-3000:]
    assert f"resume with: DONORS_FILE={variant} make rollout FROM={SECOND}\n" in out, out[-3000:]
    # Now tb-4090b does not serve: deploying tb-4090 would leave the hostname with no box.
    rc, out, _ = rollout(variant)
    assert rc == 1 and "would leave hermes.ai.unturf.com with no box" in out, out[-3000:]
    assert "rollout: batch 1/2" not in out


def test_rolling_rollout_keeps_the_hostname_served(hosts: dict[str, Host],
                                                   tmp_path: Path) -> None:
    """tb-4090 and tb-4090b serve hermes.ai.unturf.com behind tb-edge; a change that restarts
    vLLM on both is rolled out one box at a time under a bounded request loop THROUGH THE EDGE
    (a public client: no client certificate, one GET per connection, never re-sent): 0 failed
    requests, because the driver takes each box out of the edge's pool (its drain flag fails
    the edge's health checks only) and waits for nothing in flight before restarting it, and
    goes on only once the edge's health checker logged it up again. The journals show the two
    boxes never down at once."""
    from donorkit.commands.rollout_plan import Box
    from tests.support.rollout_watch import RequestLoop, outages, overlapping

    # First the fix for tb-4090b alone, resumed from where the failed rollout stopped.
    fixed = donors_variant(tmp_path, [GOOD, SECOND],
                           {"environment": {"VLLM_STANDIN_LOAD_DELAY": str(LOAD_DELAY + 1)}})
    rc, out, _ = rollout(fixed, "--from", SECOND)
    assert rc == 0 and "rollout: done, 1 boxes" in out, out[-4000:]

    change = donors_variant(tmp_path, [GOOD, SECOND],
                            {"environment": {"VLLM_STANDIN_LOAD_DELAY": str(LOAD_DELAY + 2)}})
    boxes = [Box(name, data) for name, data in load_fleet(change).items()]
    since = time.time() - 1
    tag = f"rollout{random.randrange(10**6)}"
    ran: dict[str, tuple[int, str, float]] = {}
    lock = "/opt/uncloseai/state/rollout.lock"
    with RequestLoop(boxes, HOSTNAME, "turboderp/Qwen3.8-27B-exl3", edge=hosts[EDGE].ip,
                     cafile=str(PKI / "ca.crt"), interval=0.05, max_seconds=600,
                     tag=tag) as loop:
        first = threading.Thread(target=lambda: ran.setdefault("first", rollout(change)))
        first.start()
        # A second rollout while this one runs is refused, naming the holder.
        def lock_held() -> str | None:
            if not first.is_alive():
                return None  # it ended: the assertion below says how
            return (None if ssh(hosts[SECOND], f"test -d {lock}", check=False).returncode == 0
                    else f"no {lock} on {SECOND} yet")

        why = wait_until(lock_held, 60, 0.2)
        assert why is None and first.is_alive(), (why, ran)
        second_rc, second_out, _ = rollout(change)
        first.join()
        rc, out, took = ran["first"]
        time.sleep(1)
    print(f"a second rollout meanwhile: rc {second_rc}: {second_out.strip().splitlines()[-1]}")
    assert second_rc == 2 and re.search(
        rf"rollout: refused: {GOOD}: another rollout holds {lock}: \S+@\S+ pid \d+ since ",
        second_out), second_out[-2000:]
    assert "rollout: batch" not in second_out
    for name in (GOOD, SECOND):  # the first one's locks went with it
        assert ssh(hosts[name], f"test -e {lock}", check=False).returncode != 0, name
    TIMES["rollout of 2 boxes"] = took
    answered = {h: len(loop_seqs(hosts[h], tag)) for h in (GOOD, SECOND)}
    print(f"rollout of 2 boxes in {took:.1f} s; requests through the edge: {loop.summary()}; "
          f"answered by {answered}")
    print("\n".join(line for line in out.splitlines() if line.startswith("rollout:")))
    assert rc == 0 and "rollout: done, 2 boxes" in out, out[-4000:]
    for name in (GOOD, SECOND):
        assert f"rollout: {name} out of the pools of {EDGE}, nothing in flight" in out, out[-4000:]
        assert f"rollout: {name} back in the pools of {EDGE}" in out, out[-4000:]
    windows = {h: outages(hosts[h], "vllm-qwen.service", since) for h in (GOOD, SECOND)}
    print(f"out of service: {windows}")
    assert all(len(w) == 1 and w[0][1] is not None for w in windows.values()), windows
    assert overlapping(windows) == []
    # Not one request through the edge failed across both restarts, and the loop ran across
    # the whole rollout (bounded: max_seconds; at 50 ms apart, hundreds of requests).
    assert loop.sent.get("edge", 0) > 100, loop.summary()
    assert loop.failed.get("edge", 0) == 0, loop.errors
    # Both boxes answered some of them (the edge spread the loop; each came back into its pool).
    assert all(answered.values()), answered
