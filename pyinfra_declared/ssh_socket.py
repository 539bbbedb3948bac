"""Low-latency sockets for pyinfra's SSH connections: TCP_NODELAY from the first byte, and
TCP_QUICKACK re-armed after every read (Linux). Neither pyinfra nor paramiko sets either, so
small SSH messages wait on delayed ACKs (figures: docs/benchmarks.md).

The hook is pyinfra's own: host data `ssh_paramiko_connect_kwargs` is passed to paramiko's
`SSHClient.connect`, whose `transport_factory` is handed the connected socket before the
handshake (`connect_kwargs()` is that host data's value).
"""

from __future__ import annotations

import socket
from typing import Any

import paramiko

_quickack_classes: dict[type, type] = {}


def low_latency_transport(sock: Any, **kwargs: Any) -> paramiko.Transport:
    """paramiko's `transport_factory`: the Transport, over a socket with both options set.
    A proxy command or jump-host channel (not a TCP socket) is used as it is."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock = _with_quickack(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return paramiko.Transport(sock, **kwargs)


def _with_quickack(sock: socket.socket) -> socket.socket:
    """The same connection, as a socket that re-arms TCP_QUICKACK after each read (the kernel
    drops it again on its own). Subclasses the socket's own class: under pyinfra that is
    gevent's, and a plain socket would block every other host's greenlet."""
    if not hasattr(socket, "TCP_QUICKACK"):  # not Linux: TCP_NODELAY alone
        return sock
    base = type(sock)
    if base not in _quickack_classes:
        def recv(self: socket.socket, *args: Any) -> bytes:
            data = base.recv(self, *args)
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            return data

        _quickack_classes[base] = type(f"QuickAck{base.__name__}", (base,), {"recv": recv})
    timeout = sock.gettimeout()
    quick = _quickack_classes[base](sock.family, sock.type, sock.proto, fileno=sock.detach())
    quick.settimeout(timeout)
    return quick


def connect_kwargs() -> dict[str, Any]:
    """What goes into a host's `ssh_paramiko_connect_kwargs`."""
    return {"transport_factory": low_latency_transport}
