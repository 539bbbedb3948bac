"""The operator's day: `make lock` pins a model's revision from the hub (and refuses, writing
nothing, when the hub is out of reach); `make status` shows the fleet at a glance, a drained box
and the edge's view of it included; a stopped box is said once, in one line naming it, by
status, verify, accept and rollout. Leaves the fleet serving (the stopped box booted again)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from donorkit import __version__
from donorkit.inventory.fleet import load_fleet
from donorkit.render import templates as render
from tests.support import hosts as bed
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.helpers import (
    BAD,
    DONORS,
    EDGE,
    FIXED_REVISION,
    GOOD,
    OLD,
    PKI,
    SECOND,
    TIMES,
    both_donors_in_the_pool,
    donors_variant,
    make,
    rollout,
    status_json,
)


def test_make_lock_pins_the_revision_from_the_hub(hosts: dict[str, Host], tmp_path: Path) -> None:
    """`make lock` against the testbed's stand-in hub (the real huggingface_hub client): the
    branch's commit written into the donors file that pins it, old -> new shown; with the hub
    out of reach it refuses and writes nothing."""
    stale = tmp_path / "donors.yml"
    old = "deadbeef" * 5  # (40 zeros would be YAML's integer 0: the schema refuses it)
    stale.write_text(DONORS.read_text().replace(FIXED_REVISION, old))
    rc, out = make("lock", donors=stale)
    print(out)
    assert rc == 0, out
    assert (f"lock: {stale}: overrides.models.qwen: turboderp/Qwen3.8-27B-exl3 @ main: "
            f"{old} -> {FIXED_REVISION} (served by tb-4090, tb-4090b, tb-3090, "
            "tb-olddriver)") in out, out
    assert stale.read_text() == DONORS.read_text()  # only that line changed, back to the hub's
    offline = tmp_path / "offline.yml"
    offline.write_text(stale.read_text().replace("http://10.213.0.1:8089", "http://10.213.0.1:9"))
    before = offline.read_text()
    rc, out = make("lock", donors=offline)
    print(out)
    assert rc == 2 and out.startswith("lock: REFUSED ") and "nothing written" in out, out
    assert offline.read_text() == before


def test_make_status_shows_the_fleet(hosts: dict[str, Host]) -> None:
    """`make status` on the testbed fleet: both 4090 boxes ready behind the edge with what they
    run; tb-3090 (stopped at CUDA) and tb-olddriver (refused at the preflight) have no model
    running, so the command exits 1 naming them. Then tb-4090b's drain flag: status says
    drained, and the edge's own view of it turns down, and back up without the flag."""
    both_donors_in_the_pool(hosts)
    started = time.monotonic()
    rc, out = make("status")
    TIMES["status"] = time.monotonic() - started
    print(out)
    assert rc == 2, out
    assert out.splitlines()[-1].startswith("status: 5 boxes in ")
    assert "tb-3090 qwen: not ready" in out and "tb-olddriver qwen: not ready" in out
    rc, doc = status_json()
    rows = {row["name"]: row for row in doc["hosts"]}
    for name in (GOOD, SECOND):
        row = rows[name]
        [model] = row["models"]
        assert model["ready"] and model["served"] == ["turboderp/Qwen3.8-27B-exl3"], row
        assert model["revision"] == model["pinned"] == FIXED_REVISION
        assert model["state"] == "active/running" and model["active_for_s"] >= 0
        assert (row["vllm"], row["torch"], row["toolkit"]) == ("0.26.0", "2.11.0", __version__)
        assert row["gpu"]["card"] == "NVIDIA GeForce RTX 4090" and row["gpu"]["driver"]
        assert (row["gpu"]["memory_used_mib"], row["gpu"]["memory_total_mib"]) == (1234, 24564)
        assert row["drained"] is False
        # The stand-in vLLM's /metrics (the real engine's: test_real_engine.py).
        assert model["metrics"]["vllm:num_requests_waiting"] == 0
        # The certificate the box's Caddy presented is the one our CA issued it.
        from cryptography import x509
        cert = x509.load_pem_x509_certificate((PKI / "hosts" / f"{name}.crt").read_bytes())
        assert model["cert_expires"] == cert.not_valid_after_utc.isoformat(timespec="seconds")
    units = {r["name"]: r["models"][0] for r in doc["hosts"] if r["name"] in (BAD, OLD)}
    assert all(not m["ready"] and m["state"] == "inactive/dead" for m in units.values()), units
    pool = {m["donor"]: m for m in rows[EDGE]["pool"]}
    assert set(pool) == {GOOD, SECOND} and all(m["seen"] == "up" for m in pool.values()), pool
    assert all(isinstance(m["in_flight"], int) for m in pool.values()), pool
    assert rows[EDGE]["caddy"] == "active" and rows[EDGE]["toolkit"] == __version__

    flag = render.drain_flag(load_fleet(DONORS)[SECOND])
    ssh(hosts[SECOND], f"touch {flag}")
    try:
        deadline = time.monotonic() + 30
        while True:
            rc, doc = status_json(SECOND, EDGE)
            rows = {row["name"]: row for row in doc["hosts"]}
            seen = {m["donor"]: m["seen"] for m in rows[EDGE]["pool"]}
            if seen[SECOND] == "down" or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert rows[SECOND]["drained"] is True and seen == {GOOD: "up", SECOND: "down"}, rows
        assert rc == 0, doc  # drained is not a failure: the model still answers
    finally:
        ssh(hosts[SECOND], f"rm -f {flag}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, doc = status_json(EDGE)
        if all(m["seen"] == "up" for m in doc["hosts"][0]["pool"]):
            break
        time.sleep(1)
    assert all(m["seen"] == "up" for m in doc["hosts"][0]["pool"]), doc


def test_a_stopped_box_is_one_line_everywhere(hosts: dict[str, Host], tmp_path: Path) -> None:
    """tb-4090b stopped (its container halted: nothing answers at its address): status, verify,
    accept and rollout each say so in one line naming it; the rest of the fleet is still
    shown. Then the box is booted again and serves in the edge's pool."""
    from tests.support import containers, network

    box = hosts[SECOND]
    containers.stop(SECOND, box.pid, network.netns_name(SECOND))
    try:
        said_once_everywhere(hosts, tmp_path)
    finally:
        bed.start_again(box)
        both_donors_in_the_pool(hosts)


def said_once_everywhere(hosts: dict[str, Host], tmp_path: Path) -> None:
    rc, out = make("status")
    print(out)
    assert rc == 2
    # Its one line; the edge's table still lists it as a member its health check sees down.
    mentions = [line for line in out.splitlines() if line.startswith(SECOND)]
    assert len(mentions) == 1 and "UNREACHABLE (donor, root@10.213.0.13:22)" in mentions[0], out
    assert any(line.startswith(f"{GOOD} ") for line in out.splitlines()), out

    rc, out = make("verify", f"LIMIT={SECOND}")
    print(out)
    assert rc != 0
    assert [line for line in out.splitlines() if SECOND in line] == [
        line for line in out.splitlines() if line.startswith(f"UNREACHABLE {SECOND} ")], out
    assert len([line for line in out.splitlines() if SECOND in line]) == 1, out
    assert not re.search(r"\d+ (passed|errors?|failed)\b", out), out  # no count of checks

    rc, out = make("accept", f"LIMIT={SECOND}")
    print(out)
    assert rc == 2
    assert [line for line in out.splitlines() if line.strip()] == [
        line for line in out.splitlines() if line.startswith(f"UNREACHABLE {SECOND} ")], out

    variant = donors_variant(tmp_path, [GOOD, SECOND], {})
    rc, out, _ = rollout(variant)
    print(out)
    assert rc == 1
    assert f"rollout: STOPPED: box {SECOND} (root@10.213.0.13:22) unreachable: " in out, out
    assert "rollout: batch" not in out  # stopped while taking the locks: nothing deployed
    assert ssh(hosts[GOOD], "test -e /opt/uncloseai/state/rollout.lock",
               check=False).returncode != 0  # the lock it took on tb-4090 went with it
