"""TCP_NODELAY on pyinfra's SSH connections (issue 6): a real pyinfra SSH connection to a real
paramiko SSH server on loopback, and the socket option read back from the kernel."""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.connectors.ssh import SSHConnector

from donorkit import ssh_nodelay


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


def connected_socket(port: int, tmp_path: Path) -> socket.socket:
    data = {"ssh_hostname": "127.0.0.1", "ssh_port": port, "ssh_user": "root",
            "ssh_key": str(_key_file(tmp_path, "client")),
            "ssh_known_hosts_file": str(tmp_path / "known_hosts"),
            "ssh_strict_host_key_checking": "no"}
    inventory = Inventory(([("box", data)], {}))
    state = State(inventory, Config())
    host = inventory.get_host("box")
    host.init(state)
    connector = host.connector
    assert isinstance(connector, SSHConnector)
    connector.connect()
    return connector.client.get_transport().sock


def nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_loading_our_inventory_module_turns_nodelay_on(ssh_server: int, tmp_path: Path) -> None:
    ssh_nodelay.disable()
    assert nodelay(connected_socket(ssh_server, tmp_path)) == 0  # stock pyinfra: off
    importlib.reload(importlib.import_module("donorkit.inventory"))
    assert nodelay(connected_socket(ssh_server, tmp_path)) != 0


def test_stock_switch_leaves_pyinfra_alone(ssh_server: int, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNCLOSEAI_STOCK_SSH", "1")
    ssh_nodelay.disable()
    importlib.reload(importlib.import_module("donorkit.inventory"))
    assert nodelay(connected_socket(ssh_server, tmp_path)) == 0
    ssh_nodelay.enable()
