"""The canaries on the testbed: their reference recorded on the trusted builder (tb-4090,
`donors reference`), shipped to tb-edge by its deploy; tb-edge's canary runner
(files/edge_canary.py, a round every 5 s in the testbed's inventory, out after 2 failed rounds,
back after 2 passed) keeps an honest donor in through a restart of its model, takes tb-4090b out
of the pool within the stated time once its vLLM STAND-IN answers as another checkpoint (its
answer-as file: the same model id, other tokens), with 0 failed client requests through the edge
meanwhile (tb-4090 carries the hostname), keeps it out through a `systemctl reload caddy`, and
brings it back once fixed; `donors status --json` shows the verdicts.

On the converged fleet (conftest.py): it deploys tb-4090, tb-4090b and tb-edge first (a no-op
on a converged fleet but for the reference shipped to the edge). It leaves the fleet as it found
it, but for the edge's reference: the answer-as file removed, both donors in.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

from donorkit.commands.transport import https_get
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.values import duration_seconds
from donorkit.render.canary_files import reference_path
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.helpers import (
    BIN,
    DONORS,
    EDGE,
    GOOD,
    HOSTNAME,
    PKI,
    SECOND,
    TIMES,
    changed_ops,
    deploy,
    loop_seqs,
)

STATE = "/var/lib/uncloseai-canary/state.json"
ANSWER_AS = "/etc/vllm-standin/answer-as"
CHECKPOINT = "turboderp/Qwen3.8-27B-exl3"
KNOBS = load_inventory(DONORS)[1][EDGE].canary
INTERVAL = duration_seconds(KNOBS.interval)
# A round: 2 members x 6 prompts, each a few ms on the stand-in; its timeout bounds a slow one.
ROUND = 2 * 6 * 0.1
# Out within fail_after rounds after the switch: the round under way when it happened, then
# fail_after more (an interval each), plus the Caddy load and a margin for a busy machine.
OUT_WITHIN = (KNOBS.fail_after + 1) * (INTERVAL + ROUND) + 10
BACK_WITHIN = (KNOBS.pass_after + 1) * (INTERVAL + ROUND) + 10


def donors_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "donors"), *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DONORS_FILE": str(DONORS)})


def edge_state(hosts: dict[str, Host]) -> dict[str, dict]:
    """{donor: its member's state} for the testbed's one hostname, from the edge's state file."""
    out = ssh(hosts[EDGE], f"cat {STATE} 2>/dev/null || echo '{{}}'").stdout
    members = json.loads(out).get("members", {})
    return {m["donor"]: m for m in members.values() if m["hostname"] == HOSTNAME}


def wait_for(hosts: dict[str, Host], want: dict[str, str], within: float) -> float:
    """Seconds until the edge's state gives each donor its wanted verdict (AssertionError with
    what it has past `within`)."""
    started = time.monotonic()
    while True:
        state = edge_state(hosts)
        got = {donor: (state.get(donor) or {}).get("verdict") for donor in want}
        if got == want:
            return time.monotonic() - started
        assert time.monotonic() - started < within, (want, state)
        time.sleep(0.5)


class Loop:
    """Client requests through the edge (GET /v1/models, X-Loop TAG-N), as the edge tests do."""

    def __init__(self, hosts: dict[str, Host]) -> None:
        self.ip, self.tag = hosts[EDGE].ip, f"canary{random.randrange(10**6)}"
        self.results: list[tuple[int, float, int | str]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def one(self, seq: int) -> int | str:
        try:
            return https_get(self.ip, 443, HOSTNAME, "/v1/models", PKI / "ca.crt", timeout=30,
                             headers={"X-Loop": f"{self.tag}-{seq}"})[0]
        except (OSError, http.client.HTTPException) as exc:
            return repr(exc)

    def run(self) -> None:
        started = time.monotonic()
        seq = 0
        while not self.done.is_set() and time.monotonic() - started < 600:
            self.results.append((seq, time.time(), self.one(seq)))
            seq += 1
            time.sleep(0.05)

    def __enter__(self) -> Loop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def sent(self) -> dict[int, float]:
        return {seq: at for seq, at, _ in self.results}

    def failed(self) -> list:
        return [(seq, status) for seq, _, status in self.results if status != 200]


def test_the_reference_is_recorded_on_the_trusted_builder_and_shipped(
        hosts: dict[str, Host]) -> None:
    rc, _, log, _ = deploy("--limit", GOOD, "--limit", SECOND, "--limit", EDGE)
    assert rc == 0, log[-4000:]
    # Not a trusted builder (tb-3090: cache_builder false): one line, nothing asked.
    refused = donors_cli("reference", "--limit", "tb-3090")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "field 'cache_builder': not a box the operator trusts" in refused.stderr
    result = donors_cli("reference", "--limit", GOOD)
    print(result.stdout + result.stderr)
    assert result.returncode == 0, result.stderr
    donors = load_inventory(DONORS)[0]
    box = donors[GOOD]
    path = reference_path(REPO_ROOT / KNOBS.references_dir, CHECKPOINT,
                          box.models["qwen"].revision, box.canary_stack("qwen"))
    doc = json.loads(path.read_text())
    assert (doc["checkpoint"], doc["built_by"], doc["stack"]) == (CHECKPOINT, GOOD,
                                                                  box.canary_stack("qwen"))
    assert box.canary_stack("qwen") == "rtx4090-cuda13.3-vllm0.26.0-float16-fp8-exl3"
    assert len(doc["prompts"]) == 6 and all(p["tokens"] and len(p["tokens"]) == len(
        p["logprobs"]) for p in doc["prompts"])
    # The edge's deploy ships it: both members judged against it from the next round on.
    rc, _, log, _ = deploy("--limit", EDGE)
    assert rc == 0, log[-4000:]
    config = json.loads(ssh(hosts[EDGE], "cat /etc/uncloseai/canary/canary.json").stdout)
    [site] = config["sites"]
    assert all(u["reference"]["prompts"] == [{k: p[k] for k in ("prompt", "tokens", "logprobs")}
                                             for p in doc["prompts"]]
               for u in site["upstreams"])
    took = wait_for(hosts, {GOOD: "in", SECOND: "in"}, 3 * (INTERVAL + ROUND) + 10)
    state = edge_state(hosts)
    assert all(state[d]["reference"] == box.canary_stack("qwen") for d in (GOOD, SECOND))
    print(f"both donors judged 'in' {took:.1f} s after the edge's deploy")
    # A second edge deploy changes nothing (the reference file is the same).
    rc, report, log, _ = deploy("--limit", EDGE)
    assert rc == 0 and changed_ops(report, EDGE) == [], changed_ops(report, EDGE)


def test_an_honest_donor_stays_in_through_a_restart(hosts: dict[str, Host]) -> None:
    wait_for(hosts, {GOOD: "in", SECOND: "in"}, 3 * (INTERVAL + ROUND) + 10)
    ssh(hosts[SECOND], "systemctl restart vllm-qwen.service")
    deadline = time.monotonic() + 4 * (INTERVAL + ROUND)
    seen = set()
    while time.monotonic() < deadline:
        seen.add(edge_state(hosts)[SECOND]["verdict"])
        time.sleep(0.5)
    assert seen == {"in"}, seen


def test_a_wrong_donor_is_out_within_the_stated_time_and_back_with_no_failed_request(
        hosts: dict[str, Host]) -> None:
    wait_for(hosts, {GOOD: "in", SECOND: "in"}, 3 * (INTERVAL + ROUND) + 10)
    second, edge = hosts[SECOND], hosts[EDGE]
    try:
        with Loop(hosts) as loop:
            time.sleep(3)
            switched = time.time()
            ssh(second, f"mkdir -p {Path(ANSWER_AS).parent} && echo other/checkpoint-7B "
                        f"> {ANSWER_AS}")
            took_out = wait_for(hosts, {GOOD: "in", SECOND: "out"}, OUT_WITHIN)
            out_at = time.time()
            failure = edge_state(hosts)[SECOND]["last_failure"]
            assert failure["evidence"]["first_difference"], failure
            # `donors status --json` says who is out, where and why; exit 1 (a problem).
            status = donors_cli("status", "--json", "--limit", f"{SECOND},{EDGE}")
            doc = json.loads(status.stdout)
            rows = {row["name"]: row for row in doc["hosts"]}
            [member] = [m for m in rows[EDGE]["pool"] if m["donor"] == SECOND]
            assert member["canary"]["verdict"] == "out", member
            assert rows[SECOND]["models"][0]["canary"][0]["verdict"] == "out", rows[SECOND]
            assert status.returncode == 1 and any("canary" in p for p in doc["problems"])
            time.sleep(3)
            # Anyone's reload of the edge's Caddy goes through the filter: still out.
            ssh(edge, "systemctl reload caddy")
            time.sleep(5)
            ssh(second, f"rm -f {ANSWER_AS}")
            fixed = time.time()
            took_back = wait_for(hosts, {GOOD: "in", SECOND: "in"}, BACK_WITHIN)
            back_at = time.time()
            time.sleep(5)
        journal = ssh(edge, f"journalctl -u uncloseai-canary -o cat --since=@{int(switched)}"
                      ).stdout
        assert f"OUT: {SECOND}" in journal and f"BACK IN: {SECOND}" in journal, journal
        on_second = loop_seqs(second, loop.tag)
        sent = loop.sent()
        while_out = [s for s in on_second if out_at + 1 < sent[s] < fixed]
        after = [s for s in on_second if sent[s] > back_at]
        print(f"\n{SECOND} answering as another checkpoint: out {took_out:.1f} s after the "
              f"switch (stated: within {OUT_WITHIN:.0f} s), back {took_back:.1f} s after the "
              f"fix (within {BACK_WITHIN:.0f} s); {len(loop.results)} client requests through "
              f"the edge, {len(loop.failed())} failed, {len(while_out)} reached it while out, "
              f"{len(after)} after it came back")
        print(journal)
        TIMES["canary: wrong donor out"] = took_out
        TIMES["canary: fixed donor back"] = took_back
        assert loop.failed() == [], loop.failed()
        assert while_out == [], while_out
        assert after, f"{SECOND} got no client request after it came back"
    finally:
        ssh(second, f"rm -f {ANSWER_AS}", check=False)


def test_a_restarted_edge_caddy_keeps_an_out_donor_out(hosts: dict[str, Host]) -> None:
    """caddy.service's drop-in applies the filter after a start too (ExecStartPost): a restart
    of the edge's Caddy while tb-4090b is out sends it no client request."""
    wait_for(hosts, {GOOD: "in", SECOND: "in"}, 3 * (INTERVAL + ROUND) + 10)
    second, edge = hosts[SECOND], hosts[EDGE]
    tag = f"restart{random.randrange(10**6)}"
    try:
        ssh(second, f"mkdir -p {Path(ANSWER_AS).parent} && echo other/checkpoint-7B "
                    f"> {ANSWER_AS}")
        wait_for(hosts, {GOOD: "in", SECOND: "out"}, OUT_WITHIN)
        ssh(edge, "systemctl restart caddy")
        time.sleep(2)
        statuses = [https_get(edge.ip, 443, HOSTNAME, "/v1/models", PKI / "ca.crt", timeout=30,
                              headers={"X-Loop": f"{tag}-{n}"})[0] for n in range(20)]
        assert statuses == [200] * 20, statuses
        assert loop_seqs(second, tag) == {}, "an out donor got requests after a restart"
        assert len(loop_seqs(hosts[GOOD], tag)) == 20
    finally:
        ssh(second, f"rm -f {ANSWER_AS}", check=False)
    wait_for(hosts, {GOOD: "in", SECOND: "in"}, BACK_WITHIN)
