"""Low-latency SSH sockets (issue 6): a real pyinfra SSH connection, made from the host data
our inventory gives, to a real paramiko SSH server on loopback; the socket options are read
back from the kernel."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import paramiko
import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.connectors.ssh import SSHConnector

from donorkit.box.inventory_groups import pyinfra_groups


class AcceptAnyKey(paramiko.ServerInterface):
    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"


@pytest.fixture
def ssh_server(tmp_path: Path) -> Iterator[int]:
    """An SSH server on 127.0.0.1 that accepts any key (handshake and auth only)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    host_key = paramiko.Ed25519Key.from_private_key_file(str(_key_file(tmp_path, "server")))
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(host_key)
            transport.start_server(server=AcceptAnyKey())
            transports.append(transport)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for transport in transports:
        transport.close()


def _key_file(directory: Path, name: str) -> Path:
    path = directory / f"{name}-ed25519"
    if not path.exists():
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        key = ed25519.Ed25519PrivateKey.generate()
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
    return path


def connect(port: int, tmp_path: Path, extra: dict) -> paramiko.Transport:
    """A pyinfra SSH connection to the test server, with `extra` host data."""
    data = {"ssh_hostname": "127.0.0.1", "ssh_port": port, "ssh_user": "root",
            "ssh_key": str(_key_file(tmp_path, "client")),
            "ssh_known_hosts_file": str(tmp_path / "known_hosts"),
            "ssh_strict_host_key_checking": "no", **extra}
    inventory = Inventory(([("box", data)], {}))
    state = State(inventory, Config())
    host = inventory.get_host("box")
    host.init(state)
    connector = host.connector
    assert isinstance(connector, SSHConnector)
    connector.connect()
    return connector.client.get_transport()


def option(sock: socket.socket, name: int) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, name)


def our_host_data() -> dict:
    """What donorkit/box/inventory_groups.py gives pyinfra for a donor, less the fleet's own
    fields."""
    box = SimpleNamespace(card=SimpleNamespace(name="rtx4090"), pyinfra_data=dict,
                          ssh_proxy_command=None)  # a box reached directly
    [(_, data)] = pyinfra_groups({"box": box})["donors"]
    return {key: value for key, value in data.items() if key.startswith("ssh_")}


@pytest.fixture
def nodelay_at_handshake(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """TCP_NODELAY as it is when paramiko starts the handshake, one entry a connection."""
    seen: list[int] = []
    start_client = paramiko.Transport.start_client

    def record(self: paramiko.Transport, *args: object, **kwargs: object) -> None:
        seen.append(option(self.sock, socket.TCP_NODELAY))
        start_client(self, *args, **kwargs)

    monkeypatch.setattr(paramiko.Transport, "start_client", record)
    return seen


def test_our_host_data_sets_nodelay_before_the_handshake(
        ssh_server: int, tmp_path: Path, nodelay_at_handshake: list[int]) -> None:
    connect(ssh_server, tmp_path, {})  # stock pyinfra
    connect(ssh_server, tmp_path, our_host_data())
    assert nodelay_at_handshake[0] == 0 and nodelay_at_handshake[1] != 0


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
def test_our_sockets_ack_at_once_after_every_read(ssh_server: int, tmp_path: Path) -> None:
    # After the handshake's back and forth, Linux delays ACKs (pingpong mode, read back as
    # TCP_QUICKACK 0); ours re-arms quick ACKs after each read.
    stock = connect(ssh_server, tmp_path, {})
    ours = connect(ssh_server, tmp_path, our_host_data())
    for transport in (stock, ours):
        transport.global_request("keepalive@openssh.com", wait=True)  # one more read each
    if option(stock.sock, socket.TCP_QUICKACK) == 1:
        pytest.skip("this kernel does not delay the ACKs here: nothing to tell apart")
    assert option(ours.sock, socket.TCP_QUICKACK) == 1


def test_stock_sockets_when_the_host_data_leaves_them_out(
        ssh_server: int, tmp_path: Path, nodelay_at_handshake: list[int]) -> None:
    """The benchmark's stock inventory (connect_kwargs={}): pyinfra's own sockets."""
    data = our_host_data()
    data["ssh_paramiko_connect_kwargs"] = {}
    transport = connect(ssh_server, tmp_path, data)
    assert nodelay_at_handshake == [0] and option(transport.sock, socket.TCP_NODELAY) == 0
