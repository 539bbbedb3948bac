"""A tunnel's boxes (donorkit/tunnel.py): on a home donor (`reach: tunnel`) and on its hub edges,
wg-quick@<interface> is up with the box's tunnel address, every joined peer's last handshake is
recent (`tunnel.handshake_max_age`), and a home donor's Caddy listens on its tunnel address and
loopback only, never on its home network's interfaces. Boxes without a tunnel skip."""

from __future__ import annotations

import time

import pytest
from boxcheck import listeners
from testinfra.host import Host


def _tunnel(data: dict) -> dict:
    if not data.get("tunnel"):
        pytest.skip("reached directly: no tunnel")
    return data["tunnel"]


def _up(box: Host, tunnel: dict) -> None:
    unit = f"wg-quick@{tunnel['interface']}"
    state = box.run(f"systemctl is-active {unit}").stdout.strip()
    assert state == "active", f"{unit} is {state or 'unknown'}"
    shown = box.check_output(f"ip -o -4 addr show dev {tunnel['interface']}")
    assert f" {tunnel['address']}/" in shown, f"{tunnel['address']} not on the interface: {shown}"


def _handshakes(box: Host, tunnel: dict) -> None:
    out = box.check_output(f"wg show {tunnel['interface']} latest-handshakes")
    seen = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    now = time.time()
    for peer in tunnel["peers"]:
        at = int(seen.get(peer["public_key"], "0") or 0)
        assert at, f"no handshake ever with {peer['name']} ({peer['address']})"
        age = now - at
        assert age <= tunnel["handshake_max_age"], (
            f"last handshake with {peer['name']} {age:.0f} s ago (more than "
            f"{tunnel['handshake_max_age']} s: the tunnel is down)")


def test_tunnel_up(host: Host, data: dict) -> None:
    _up(host, _tunnel(data))


def test_tunnel_handshake_recent(host: Host, data: dict) -> None:
    _handshakes(host, _tunnel(data))


def test_caddy_on_the_tunnel_and_loopback_only(host: Host, data: dict) -> None:
    tunnel = _tunnel(data)
    port = data["caddy_https_port"]
    bound = {address for address, p, procs in listeners(host.check_output("ss -ltnpH"))
             if p == port and "caddy" in procs.split(",")}
    assert bound, f"Caddy does not listen on port {port}"
    assert bound <= {tunnel["address"], "127.0.0.1"}, (
        f"Caddy listens on {sorted(bound)}: only {tunnel['address']} and 127.0.0.1 may be bound")


def test_edge_tunnel_up(edge_host: Host, edge_data: dict) -> None:
    _up(edge_host, _tunnel(edge_data))


def test_edge_tunnel_handshakes_recent(edge_host: Host, edge_data: dict) -> None:
    _handshakes(edge_host, _tunnel(edge_data))
