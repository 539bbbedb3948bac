"""How this machine (the operator's) talks to boxes and edges, one way each: HTTPS with a public
hostname as SNI and Host, our CA and a client certificate (`https_get`, `PinnedHTTPS`,
`client_context`); commands over SSH with the inventory's SSH data (`SshRunner`); a home donor's
Caddy on a local port through its edge (`SshForward`); polling to a deadline (`wait_until`).

What a box sends back is the box owner's: every read is capped in bytes (ANSWER_LIMIT) and in
wall time for the whole exchange (`Deadline`), and every field printed or recorded goes through
`shown` (bounded, control and bidi characters escaped).
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
import threading
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from donorkit.inventory.errors import AnswerTooLarge
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.ssh_commands import forward_command

if TYPE_CHECKING:
    from donorkit.inventory.host_data import DonorBox, EdgeBox, SshJump

T = TypeVar("T")

# The most one answer of a box may be, in bytes (a status command's output, /v1/models, a
# /metrics page, one completion or stream of `make accept`).
ANSWER_LIMIT = 8 << 20


# ---------------------------------------------------------------- text from a box -------------
# Characters shown escaped: control (C0, DEL, C1: ESC starts the sequences that retitle or clear
# a terminal), format (bidi overrides and isolates, zero-width), line and paragraph separators,
# surrogates; and the backslash, so that an escape shown is never the box's own text.
_ESCAPED = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if unicodedata.category(char) not in _ESCAPED:
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def shown(text: object, limit: int = 200) -> str:
    """Text from a box as it may be printed or recorded: control, format and separator
    characters (and the backslash) escaped as Python writes them (`\\x1b`, `\\u202e`), at most
    `limit` characters of that, then `...(N more)` where it was longer. Not text (None, a
    number): its str(), the same way."""
    text = text if isinstance(text, str) else str(text)
    out: list[str] = []
    used = 0
    for i, char in enumerate(text):
        piece = _escape(char)
        if used + len(piece) > limit:
            return "".join(out) + f"...({len(text) - i} more)"
        out.append(piece)
        used += len(piece)
    return "".join(out)


class Deadline:
    """One exchange with a box bounded in wall time, whatever the box does: `seconds` after the
    `with` starts, `cut` (given with `arm`: shut the socket down, close the SSH channel) runs in
    a timer thread, so a read blocked on a box that trickles bytes returns at once; leaving the
    `with` after that raises TimeoutError naming `what`, whatever the read made of it."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.expired = False
        self._cut: Callable[[], object] | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def arm(self, cut: Callable[[], object]) -> None:
        """What cuts the exchange off; run at once if the time is already up."""
        with self._lock:
            self._cut = cut
            if not self.expired:
                return
        self._run_cut()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
        self._run_cut()

    def _run_cut(self) -> None:
        try:
            if self._cut:
                self._cut()
        except Exception:  # noqa: BLE001 - already broken (paramiko's EOFError): cut anyway
            pass

    def __exit__(self, kind, exc, tb) -> None:
        self._timer.cancel()
        if self.expired:
            raise TimeoutError(f"{self.what}: no whole answer within {self.seconds:g} s") \
                from exc


def _shut(sock: socket.socket | None) -> None:
    """Shut a socket down (a TLS one too, under its TLS layer): a read blocked on it returns."""
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or already closed: nothing left to cut


def read_capped(read: Callable[[int], bytes], limit: int, what: str) -> bytes:
    """Everything `read(n)` gives until it gives b'', refused past `limit` bytes."""
    chunks, size = [], 0
    while chunk := read(65536):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"{what}: answer longer than {limit} bytes: not read on")
        chunks.append(chunk)
    return b"".join(chunks)


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
    stdout are the TCP stream (a home donor's `ssh -W` through the edge,
    donorkit/inventory/tunnel_plan.py)."""

    def __init__(self, address: str, port: int, hostname: str, context: ssl.SSLContext,
                 timeout: float, proxy: list[str] | None = None) -> None:
        super().__init__(hostname, port, context=context, timeout=timeout)
        self._address = address
        self._proxy = proxy
        self._raw: socket.socket | None = None
        self._cut = False
        self.peer_cert: dict | None = None  # the server's certificate, once connected

    def cut(self) -> None:
        """Shut the connection's socket down, now or as soon as it exists (Deadline's cut): a
        handshake or a read blocked on it returns."""
        self._cut = True
        _shut(self._raw)

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
        self._raw = raw
        if self._cut:
            _shut(raw)
        # The handshake after the TLS socket is known: a cut meanwhile reaches it.
        sock = self._context.wrap_socket(raw, server_hostname=self.host,
                                         do_handshake_on_connect=False)
        self._raw = sock
        if self._cut:
            _shut(sock)
        self.sock = sock
        sock.do_handshake()
        self.peer_cert = sock.getpeercert()


def pinned_get(connection: PinnedHTTPS, path: str, headers: dict[str, str] | None = None,
               limit: int = ANSWER_LIMIT) -> tuple[int, str]:
    """GET `path` on `connection`: (status, body), the whole exchange (connecting included)
    within the connection's timeout and the body within `limit` bytes (Deadline,
    AnswerTooLarge). TLS, connection and HTTP errors are raised (OSError,
    http.client.HTTPException)."""
    status, body = pinned_request(connection, "GET", path, headers, None, limit)
    return status, body.decode(errors="replace")


def pinned_request(connection: PinnedHTTPS, method: str, path: str,
                   headers: dict[str, str] | None = None, body: bytes | None = None,
                   limit: int = ANSWER_LIMIT) -> tuple[int, bytes]:
    """`method` `path` on `connection` (a POST with its body): (status, raw body), bounded as
    pinned_get."""
    what = f"https://{connection.host}:{connection.port}{path}"
    with Deadline(connection.timeout, what) as deadline:
        deadline.arm(connection.cut)
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        raw = read_capped(response.read1, limit, what)
    return response.status, raw


def within(seconds: float, what: str, work: Callable[[], T]) -> T:
    """`work()`'s result, or TimeoutError once `seconds` have passed: it runs in a daemon
    thread, abandoned then (for a client whose reads cannot be cut from outside, such as
    huggingface_hub's; its own read timeouts end it later)."""
    done: list = []

    def run() -> None:
        try:
            done.append((True, work()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it was raised
            done.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not done:
        raise TimeoutError(f"{what}: no whole answer within {seconds:g} s")
    ok, value = done[0]
    if not ok:
        raise value
    return value


def capped_transport(seconds: float, limit: int = ANSWER_LIMIT, **kwargs):
    """An httpx2 transport (huggingface_hub's client) whose answers are refused past `limit`
    bytes (AnswerTooLarge) and past `seconds` from the request (TimeoutError, checked at each
    chunk: `within` bounds a read that blocks)."""
    import httpx2

    class Capped(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            deadline = time.monotonic() + seconds
            response = super().handle_request(request)
            response.stream = _CappedStream(response.stream, deadline, limit, str(request.url))
            return response

    class _CappedStream(httpx2.SyncByteStream):
        def __init__(self, stream, deadline: float, limit: int, what: str) -> None:
            self._stream, self._deadline, self._limit, self._what = stream, deadline, limit, what

        def __iter__(self):
            size = 0
            for chunk in self._stream:
                size += len(chunk)
                if size > self._limit:
                    raise AnswerTooLarge(f"{self._what}: answer longer than {self._limit} "
                                         "bytes: not read on")
                if time.monotonic() > self._deadline:
                    raise TimeoutError(f"{self._what}: no whole answer within {seconds:g} s")
                yield chunk

        def close(self) -> None:
            self._stream.close()

    return Capped(**kwargs)


def capped_async_transport(seconds: float, limit: int = ANSWER_LIMIT, sni: str | None = None,
                           **kwargs):
    """An httpx2 async transport (`make accept`'s OpenAI client): `sni` as the TLS server name
    when given; each answer, headers and body, within `seconds` from its request (a real
    deadline: the read waiting on a box that trickles is cancelled) and `limit` bytes."""
    import asyncio

    import httpx2

    def late(request: httpx2.Request) -> httpx2.ReadTimeout:
        return httpx2.ReadTimeout(f"{request.method} {request.url}: no whole answer within "
                                  f"{seconds:g} s", request=request)

    class CappedAsync(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            if sni and request.url.scheme == "https":
                request.extensions["sni_hostname"] = sni
            deadline = time.monotonic() + seconds
            try:
                response = await asyncio.wait_for(super().handle_async_request(request),
                                                  seconds)
            except TimeoutError:
                raise late(request) from None
            response.stream = _CappedAsyncStream(response.stream, deadline, request)
            return response

    class _CappedAsyncStream(httpx2.AsyncByteStream):
        def __init__(self, stream, deadline: float, request: httpx2.Request) -> None:
            self._stream, self._deadline, self._request = stream, deadline, request

        async def __aiter__(self):
            size, chunks = 0, self._stream.__aiter__()
            while True:
                try:
                    chunk = await asyncio.wait_for(
                        chunks.__anext__(), max(self._deadline - time.monotonic(), 0))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise late(self._request) from None
                size += len(chunk)
                if size > limit:
                    raise AnswerTooLarge(f"{self._request.method} {self._request.url}: answer "
                                         f"longer than {limit} bytes: not read on")
                yield chunk

        async def aclose(self) -> None:
            await self._stream.aclose()

    return CappedAsync(**kwargs)


def https_get(address: str, port: int, hostname: str, path: str, ca: Path | str | None,
              client: tuple[Path | str, Path | str] | None = None, timeout: float = 60,
              headers: dict[str, str] | None = None,
              proxy: list[str] | None = None, limit: int = ANSWER_LIMIT) -> tuple[int, str]:
    """GET https://hostname:port/path from `address` (through `proxy`, as PinnedHTTPS):
    (status, body), as pinned_get: within `timeout` seconds in all and `limit` bytes."""
    connection = PinnedHTTPS(address, port, hostname, client_context(ca, client), timeout,
                             proxy)
    try:
        return pinned_get(connection, path, headers, limit)
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
    """A home donor (donorkit/inventory/tunnel_plan.py): its SSH stream through the edge (OpenSSH's
    `-W`), as a socket for paramiko; None for a box reached directly (an edge always is)."""
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
        self._where = f"{data.ssh_hostname}:{data.ssh_port}"

    def run(self, command: str, timeout: float = 60, limit: int = ANSWER_LIMIT
            ) -> tuple[int, str]:
        """(exit status, stdout; stdout and stderr when it failed), within `timeout` seconds for
        the whole command and `limit` bytes for each of its outputs (Deadline, AnswerTooLarge:
        the channel is closed)."""
        if self._sudo:
            command = f"sudo -n sh -c {shlex.quote(command)}"
        what = f"the command on {self._where}"
        _, stdout, stderr = self._client.exec_command(command, timeout=timeout)
        channel = stdout.channel
        try:
            with Deadline(timeout, what) as deadline:
                deadline.arm(channel.close)
                out = read_capped(stdout.read, limit, f"{what} (stdout)").decode(errors="replace")
                err = read_capped(stderr.read, limit, f"{what} (stderr)").decode(errors="replace")
                rc = channel.recv_exit_status()
        finally:
            channel.close()
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
    edge (donorkit.inventory.ssh_commands.forward_command: the edge's own SSH data, its host key
    checked, no prompt), its words as argv, never through a shell. Entering waits until the forward
    listens, else raises ForwardError; leaving stops ssh. Each connection to the local port is a
    channel of the one SSH connection: no handshake of its own.

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
