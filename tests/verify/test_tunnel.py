"""A tunnel's boxes (donorkit/inventory/tunnel_plan.py): on a home donor (`reach: tunnel`) and on
its hub edges, wg-quick@<interface> is up with the box's tunnel address, every joined peer's last
handshake is recent (`tunnel.handshake_max_age`), and a home donor's Caddy listens on its tunnel
address and loopback only, never on its home network's interfaces. Only the boxes of a tunnel get
these cases (a fleet without one has none: nothing skipped per box)."""

from __future__ import annotations

import time

import pytest
from boxcheck import listeners
from conftest import connected, selected_donors, selected_edges
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, DonorTunnel, EdgeBox, EdgeTunnel


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`home_donor` over the selected donors with a tunnel, `hub` over the selected edges with
    one (their ids are the box names, as the suite's other checks)."""
    for fixture, boxes in (("home_donor", selected_donors), ("hub", selected_edges)):
        if fixture in metafunc.fixturenames:
            names = [name for name, data in boxes(metafunc.config).items() if data.tunnel]
            metafunc.parametrize(fixture, names, ids=names)


@pytest.fixture
def home(home_donor: str, request: pytest.FixtureRequest) -> tuple[Host, DonorBox]:
    data = selected_donors(request.config)[home_donor]
    return connected(home_donor, data, request), data


@pytest.fixture
def hub_box(hub: str, request: pytest.FixtureRequest) -> tuple[Host, EdgeBox]:
    data = selected_edges(request.config)[hub]
    return connected(hub, data, request), data


def _up(box: Host, tunnel: DonorTunnel | EdgeTunnel) -> None:
    unit = f"wg-quick@{tunnel.interface}"
    state = box.run(f"systemctl is-active {unit}").stdout.strip()
    assert state == "active", f"{unit} is {state or 'unknown'}"
    shown = box.check_output(f"ip -o -4 addr show dev {tunnel.interface}")
    assert f" {tunnel.address}/" in shown, f"{tunnel.address} not on the interface: {shown}"


def _handshakes(box: Host, tunnel: DonorTunnel | EdgeTunnel) -> None:
    out = box.check_output(f"wg show {tunnel.interface} latest-handshakes")
    seen = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    now = time.time()
    for peer in tunnel.peers:
        at = int(seen.get(peer.public_key, "0") or 0)
        assert at, f"no handshake ever with {peer.name} ({peer.address})"
        age = now - at
        assert age <= tunnel.handshake_max_age, (
            f"last handshake with {peer.name} {age:.0f} s ago (more than "
            f"{tunnel.handshake_max_age} s: the tunnel is down)")


def test_tunnel_up(home: tuple[Host, DonorBox]) -> None:
    _up(home[0], home[1].tunnel)


def test_tunnel_handshake_recent(home: tuple[Host, DonorBox]) -> None:
    _handshakes(home[0], home[1].tunnel)


def test_caddy_on_the_tunnel_and_loopback_only(home: tuple[Host, DonorBox]) -> None:
    host, data = home
    tunnel = data.tunnel
    port = data.caddy_https_port
    bound = {address for address, p, procs in listeners(host.check_output("ss -ltnpH"))
             if p == port and "caddy" in procs.split(",")}
    assert bound, f"Caddy does not listen on port {port}"
    assert bound <= {tunnel.address, "127.0.0.1"}, (
        f"Caddy listens on {sorted(bound)}: only {tunnel.address} and 127.0.0.1 may be bound")


def test_edge_tunnel_up(hub_box: tuple[Host, EdgeBox]) -> None:
    _up(hub_box[0], hub_box[1].tunnel)


def test_edge_tunnel_handshakes_recent(hub_box: tuple[Host, EdgeBox]) -> None:
    _handshakes(hub_box[0], hub_box[1].tunnel)
