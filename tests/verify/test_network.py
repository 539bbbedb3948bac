"""Loopback only: vLLM never binds a public interface; only Caddy listens on the public port."""

from __future__ import annotations

import ipaddress

import pytest
from boxcheck import listeners, missing
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel

LOOPBACK = {"127.0.0.1", "::1"}


def _need_ss(host: Host) -> None:
    if not host.exists("ss"):
        missing(host, "ss (iproute2) is not installed: the listening sockets cannot be listed")


def _tcp_listeners(host: Host, port: int) -> list[str]:
    """Addresses listening on TCP `port`, from the FULL list (is_listening is also true for
    0.0.0.0 and ::, so it cannot prove loopback-only)."""
    _need_ss(host)
    found = []
    for sock in host.socket.get_listening_sockets():
        if not sock.startswith("tcp://"):
            continue
        address, _, sock_port = sock[len("tcp://"):].rpartition(":")
        if int(sock_port) == port:
            found.append(address)
    return found


def _is_loopback(address: str) -> bool:
    address = address.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return str(ip) in LOOPBACK


def test_vllm_port_loopback_only(host: Host, m: ServedModel) -> None:
    addresses = _tcp_listeners(host, m.port)
    if not addresses:
        pytest.fail(f"nothing listens on port {m.port} ({m.unit} not running?)",
                    pytrace=False)
    public = [a for a in addresses if not _is_loopback(a)]
    assert not public, f"port {m.port} ({m.name}) is bound on {public}: not loopback only"


def test_only_caddy_on_public_port(host: Host, data: DonorBox) -> None:
    port = data.caddy_https_port
    _need_ss(host)
    out = host.check_output("ss -ltnpH")
    on_port = [(a, p, procs) for a, p, procs in listeners(out) if p == port]
    if not on_port:
        missing(host, f"nothing listens on the public port {port} (Caddy down?)")
    others = [(a, procs) for a, _, procs in on_port if set(procs.split(",")) != {"caddy"}]
    assert not others, f"port {port} has listeners other than caddy: {others}"
