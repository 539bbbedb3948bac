"""How this machine (the operator's) talks to boxes and edges, one way each:

- `https_get` / `PinnedHTTPS`: HTTPS to an address with a public hostname as SNI and Host (a
  donor's Caddy picks its site by both, as the edge asks it), verified against our CA, with a
  client certificate where given (donors answer only a client certificate of our CA);
- `client_context`: the TLS context of that client (also what `make accept`'s OpenAI client
  gets);
- `SshRunner`: commands on a host over SSH with the inventory's SSH data (its key, port and
  known_hosts file: an unknown or changed host key is refused; sudo for a user not root);
- `SshForward`: a home donor's Caddy on a loopback port here for as long as a `with` lasts (one
  OpenSSH local forward through its edge: `make accept`'s many requests pay no SSH handshake
  each, where `PinnedHTTPS(proxy=...)` starts one `ssh -W` per connection);
- `wait_until`: poll a check until it passes or a deadline passes, saying why it did not.

Paths on this machine (the CA, the client pairs) come from donorkit.paths' one resolver; Caddy's
durations from donorkit.values.duration_ns.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import shlex
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from donorkit.paths import pki_dir

if TYPE_CHECKING:
    from donorkit.host_data import DonorBox, EdgeBox, SshJump

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


class ForwardError(OSError):
    """An SSH forward that did not come up, and why (one line: ssh's own last words)."""

    ssh_said = ""  # all ssh wrote on stderr, where it had ended


def _end_with_parent(signum: int) -> Callable[[], None]:
    """A Popen `preexec_fn`: the child gets `signum` when the thread that started it ends
    (prctl PR_SET_PDEATHSIG; Linux, as the operator's machine is). A parent already gone by then
    sends the signal at once."""
    libc = ctypes.CDLL(None, use_errno=True)  # looked up here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(1, signum)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return arm


class SshForward:
    """`address:port` as the edge reaches it (a home donor's Caddy at its tunnel address), on
    127.0.0.1:`local_port` here while the `with` lasts: one OpenSSH local forward through the
    edge (donorkit.tunnel.forward_command: the edge's own SSH data, its host key checked, no
    prompt), its words as argv, never through a shell. Entering waits until the forward listens,
    else raises ForwardError; leaving stops ssh. Each connection to the local port is a channel
    of the one SSH connection: no handshake of its own.

    The local port is the kernel's pick a moment before ssh binds it: if another process took it
    meanwhile, ssh says so and exits (ExitOnForwardFailure) and another port is tried, up to
    `PORT_TRIES` in all. ssh ends with the thread that started it (Linux's parent-death
    signal): a `make accept` killed outright (SIGKILL, or a SIGTERM that Python does not clean
    up after) leaves no ssh -N behind. So start it in the thread that uses it."""

    PORT_TRIES = 3

    def __init__(self, jump: SshJump, address: str, port: int, timeout: float = 30) -> None:
        self.jump, self.address, self.port, self.timeout = jump, address, port, timeout
        self.local_port = 0
        self._process: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> SshForward:
        for _ in range(self.PORT_TRIES - 1):
            try:
                return self._start()
            except ForwardError as exc:
                if "Address already in use" not in exc.ssh_said:
                    raise
        return self._start()

    def _start(self) -> SshForward:
        from donorkit.tunnel import forward_command  # tunnel.py's value types import schema

        self.local_port = free_port()
        self._log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while it runs
        self._process = subprocess.Popen(
            forward_command(self.jump, self.local_port, self.address, self.port),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            preexec_fn=_end_with_parent(signal.SIGTERM))
        try:
            why = wait_until(self._listening, self.timeout, interval=0.1)
        except ForwardError as exc:
            exc.ssh_said = self._log_text()
            self.close()
            raise
        if why:
            said = self.said()
            self.close()
            raise ForwardError(f"{why} after {self.timeout:g} s"
                               + (f" (ssh: {said})" if said else ""))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _listening(self) -> str | None:
        """None once the local port accepts; why not yet; ForwardError when ssh has ended."""
        if self._process.poll() is not None:
            raise ForwardError(f"ssh to {self.jump.ssh_user}@{self.jump.ssh_hostname}:"
                               f"{self.jump.ssh_port} exited with status "
                               f"{self._process.returncode}: {self.said() or 'no message'}")
        try:
            socket.create_connection(("127.0.0.1", self.local_port), 1).close()
        except OSError as exc:
            return f"nothing listens on 127.0.0.1:{self.local_port} ({exc})"
        return None

    def said(self) -> str:
        """ssh's last line on stderr so far ('' if none): why a channel or the forward failed."""
        lines = self._log_text().strip().splitlines()
        return lines[-1].strip()[:300] if lines else ""

    def _log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def close(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log:
            self._log.close()
            self._log = None


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the kernel's pick; a process that takes it first makes
    the forward fail at once: ExitOnForwardFailure)."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


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
