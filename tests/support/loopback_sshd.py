"""A real SSH server on 127.0.0.1 for the host-free tests (paramiko's server side): any client
key is let in, and it opens direct-tcpip channels (what OpenSSH's `-W` and `-L` ask for) to the
address asked, as an edge's sshd does. With `exec_reply`, a command (an exec request) is answered
by that function of the command and the channel, as a box would answer it (a hostile box: escape
sequences, a huge output, a trickle). `serve` yields its port and writes what a client needs: a
client key, and a known_hosts file with its host key."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from pyinfra_declared.tests.test_ssh_socket import _key_file  # the same key maker


@dataclass
class LoopbackSshd:
    port: int
    client_key: Path
    known_hosts: Path
    opened: list[tuple[str, int]] = field(default_factory=list)  # channels asked for
    sessions: list[paramiko.Transport] = field(default_factory=list)  # SSH connections made


class _Forwarding(paramiko.ServerInterface):
    """Any key in; a direct-tcpip channel opens only where the destination accepts a
    connection (else OpenSSH's client says `open failed: connect failed`)."""

    def __init__(self, server: LoopbackSshd,
                 exec_reply: Callable[[str, paramiko.Channel], None] | None = None) -> None:
        self.server = server
        self.pending: dict[int, socket.socket] = {}
        self.exec_reply = exec_reply

    def check_channel_request(self, kind: str, chanid: int) -> int:
        if kind == "session" and self.exec_reply:
            return paramiko.OPEN_SUCCEEDED
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        if not self.exec_reply:
            return False
        threading.Thread(target=_answer, args=(self.exec_reply, command.decode(), channel),
                         daemon=True).start()
        return True

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_channel_direct_tcpip_request(self, chanid: int, origin: tuple,
                                           destination: tuple) -> int:
        self.server.opened.append((destination[0], destination[1]))
        try:
            self.pending[chanid] = socket.create_connection(destination, 3)
        except OSError:
            return paramiko.OPEN_FAILED_CONNECT_FAILED
        return paramiko.OPEN_SUCCEEDED


def _answer(reply: Callable[[str, paramiko.Channel], None], command: str,
            channel: paramiko.Channel) -> None:
    # Started while paramiko still has to acknowledge the request: a channel closed before
    # that acknowledgement reads as a refused command to the client.
    time.sleep(0.2)
    try:
        reply(command, channel)
        channel.send_exit_status(0)
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the client closed the channel
    finally:
        channel.close()


def _pump(source_recv, sink_send, done) -> None:
    try:
        while data := source_recv(65536):
            sink_send(data)
    except OSError:
        pass
    finally:
        done()


def _relay(channel: paramiko.Channel, sock: socket.socket) -> None:
    threading.Thread(target=_pump, args=(channel.recv, sock.sendall,
                                         lambda: _shutdown(sock)), daemon=True).start()
    threading.Thread(target=_pump, args=(sock.recv, channel.sendall,
                                         channel.shutdown_write), daemon=True).start()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _session(conn: socket.socket, host_key: paramiko.PKey, server: LoopbackSshd,
             exec_reply: Callable[[str, paramiko.Channel], None] | None) -> None:
    transport = paramiko.Transport(conn)
    server.sessions.append(transport)
    transport.add_server_key(host_key)
    handler = _Forwarding(server, exec_reply)
    try:
        transport.start_server(server=handler)
    except (paramiko.SSHException, EOFError, OSError):
        return
    while transport.is_active():
        channel = transport.accept(0.5)
        if channel is not None and channel.get_id() in handler.pending:
            _relay(channel, handler.pending.pop(channel.get_id()))


@contextmanager
def serve(directory: Path, exec_reply: Callable[[str, paramiko.Channel], None] | None = None
          ) -> Iterator[LoopbackSshd]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    host_key = paramiko.Ed25519Key.from_private_key_file(str(_key_file(directory, "host")))
    known_hosts = directory / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_key.get_name()} {host_key.get_base64()}\n")
    server = LoopbackSshd(port, _key_file(directory, "client"), known_hosts)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_session, args=(conn, host_key, server, exec_reply),
                             daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server
    finally:
        listener.close()
        for transport in server.sessions:
            transport.close()
