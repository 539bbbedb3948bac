"""How this machine (the operator's) talks to boxes and edges, one way each:

- `https_get` / `PinnedHTTPS`: HTTPS to an address with a public hostname as SNI and Host (a
  donor's Caddy picks its site by both, as the edge asks it), verified against our CA, with a
  client certificate where given (donors answer only a client certificate of our CA);
- `client_context`: the TLS context of that client (also what `make accept`'s OpenAI client
  gets);
- `SshRunner`: commands on a host over SSH with the inventory's SSH data (its key, port and
  known_hosts file: an unknown or changed host key is refused; sudo for a user not root);
- `wait_until`: poll a check until it passes or a deadline passes, saying why it did not.

Paths on this machine (the CA, the client pairs) come from donorkit.paths' one resolver; Caddy's
durations from donorkit.values.duration_ns.
"""

from __future__ import annotations

import http.client
import os
import shlex
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from donorkit.paths import pki_dir

if TYPE_CHECKING:
    from donorkit.host_data import DonorBox, EdgeBox

T = TypeVar("T")


def client_context(ca: Path | str | None, client: tuple[Path | str, Path | str] | None = None
                   ) -> ssl.SSLContext:
    """Verify the server against `ca` (our CA; the system's CAs when None) and present `client`
    (certificate, key) when given."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if client:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


class PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to `address`, with `hostname` as SNI and Host (one connection, one request: no
    keep-alive across requests, as every hop to vLLM). `proxy`: a command whose stdin and
    stdout are the TCP stream (a home donor's `ssh -W` through the edge, donorkit/tunnel.py)."""

    def __init__(self, address: str, port: int, hostname: str, context: ssl.SSLContext,
                 timeout: float, proxy: list[str] | None = None) -> None:
        super().__init__(hostname, port, context=context, timeout=timeout)
        self._address = address
        self._proxy = proxy

    def connect(self) -> None:
        if self._proxy:
            raw, theirs = socket.socketpair()
            # The command's end blocks (a command writes its stdout expecting that: on a
            # non-blocking one it fails with EAGAIN), whatever made our sockets non-blocking.
            os.set_blocking(theirs.fileno(), True)
            # Not killed when the connection closes: http.client closes it as soon as the
            # response starts (Connection: close) while the body still flows through the
            # command; the command ends by itself at the end of the stream (ssh -W: EOF).
            with theirs:
                subprocess.Popen(self._proxy, stdin=theirs, stdout=theirs,
                                 stderr=subprocess.DEVNULL)
            raw.settimeout(self.timeout)
        else:
            raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def https_get(address: str, port: int, hostname: str, path: str, ca: Path | str | None,
              client: tuple[Path | str, Path | str] | None = None, timeout: float = 60,
              headers: dict[str, str] | None = None,
              proxy: list[str] | None = None) -> tuple[int, str]:
    """GET https://hostname:port/path from `address` (through `proxy`, as PinnedHTTPS):
    (status, body). TLS, connection and HTTP errors are raised (OSError,
    http.client.HTTPException)."""
    connection = PinnedHTTPS(address, port, hostname, client_context(ca, client), timeout,
                             proxy)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def ca_file(data: DonorBox | EdgeBox) -> Path:
    """Our CA's certificate on this machine, for a host's data."""
    return pki_dir(data) / "ca.crt"


def edge_client_pair(data: DonorBox | EdgeBox, edge: str) -> tuple[Path, Path]:
    """An edge's client certificate and key on this machine: what the edge itself presents to a
    donor (tasks/edge_caddy.py uploads the same pair)."""
    edges = pki_dir(data) / "edges"
    return edges / f"{edge}.crt", edges / f"{edge}.key"


def jump_socket(data: DonorBox | EdgeBox):
    """A home donor (donorkit/tunnel.py): its SSH stream through the edge (OpenSSH's `-W`), as
    a socket for paramiko; None for a box reached directly (an edge always is)."""
    command = getattr(data, "ssh_proxy_command", None)
    if not command:
        return None
    import paramiko

    return paramiko.ProxyCommand(shlex.join(command))


def ssh_client(data: DonorBox | EdgeBox, timeout: float, known_hosts: str | None = None,
               accept_unknown: bool = False):
    """A connected paramiko client for a host, with the inventory's SSH data: its address, port,
    user and key, through the edge for a home donor. Host keys from `known_hosts` (else the
    host's `ssh_known_hosts_file`, else the system's); an unknown key is refused unless
    `accept_unknown` (a changed key is refused whatever the policy: paramiko's
    BadHostKeyException)."""
    import paramiko  # only the commands that open SSH themselves pay for the import

    client = paramiko.SSHClient()
    known = known_hosts or data.ssh_known_hosts_file
    if known:
        client.load_host_keys(known)
    else:
        client.load_system_host_keys()
    client.set_missing_host_key_policy(
        paramiko.WarningPolicy() if accept_unknown else paramiko.RejectPolicy())
    client.connect(hostname=data.ssh_hostname, port=data.ssh_port, username=data.ssh_user,
                   key_filename=data.ssh_key, timeout=timeout, banner_timeout=timeout,
                   auth_timeout=timeout, sock=jump_socket(data))
    return client


class SshRunner:
    """Commands on a host over SSH with the inventory's SSH data (key, port, known_hosts: an
    unknown or changed host key is refused; sudo for a user other than root)."""

    def __init__(self, data: DonorBox | EdgeBox, timeout: float = 30) -> None:
        self._client = ssh_client(data, timeout)
        self._sudo = data.sudo

    def run(self, command: str, timeout: float = 60) -> tuple[int, str]:
        """(exit status, stdout; stdout and stderr when it failed)."""
        if self._sudo:
            command = f"sudo -n sh -c {shlex.quote(command)}"
        _, stdout, stderr = self._client.exec_command(command, timeout=timeout)
        out, err = stdout.read().decode(), stderr.read().decode()
        rc = stdout.channel.recv_exit_status()
        return rc, out if rc == 0 else (out + err).strip()

    def close(self) -> None:
        self._client.close()


def wait_until(check: Callable[[], T | None], timeout: float, interval: float = 1.0,
               sleep: Callable[[float], None] = time.sleep) -> T | None:
    """Call `check` until it returns None (done) or `timeout` seconds have passed; return None,
    or what the last call returned (why it is not done yet). `check` runs at least once."""
    deadline = time.monotonic() + timeout
    while True:
        why = check()
        if why is None or time.monotonic() + interval > deadline:
            return why
        sleep(interval)
