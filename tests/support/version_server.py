"""A stand-in for a donor's Caddy in the host-free tests of `make accept`: HTTPS on one address
with a server certificate of our CA for a public name, answering GET /version with JSON; with
`client_ca`, only a client certificate of our client CA gets in (as a donor's Caddy). It records
the server name each handshake asked for (SNI) and the Host of each request. `answers`: other
paths answered by a function of the request handler (a hostile box: escape sequences, a huge
body, a trickle)."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from donorkit.inventory.pki import Pki


@dataclass
class VersionServer:
    port: int
    names: list[str | None] = field(default_factory=list)  # SNI, a handshake each
    hosts: list[str] = field(default_factory=list)  # Host, a request each

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@contextmanager
def serve(pki: Pki, box: str, hostname: str, version: str, folder: Path,
          address: str = "127.0.0.1", client_ca: bool = False,
          answers: dict[str, Callable[[BaseHTTPRequestHandler], None]] | None = None
          ) -> Iterator[VersionServer]:
    """Serve until the `with` ends; `box` names the server certificate, issued for `hostname`
    (its pair written into `folder`)."""
    cert, key = pki.server_cert(box, [hostname])
    (folder / "c.pem").write_text(cert)
    (folder / "k.pem").write_text(key)
    body = json.dumps({"version": version}).encode()
    names: list[str | None] = []
    hosts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hosts.append(self.headers["Host"])
            if self.path in (answers or {}):
                try:
                    answers[self.path](self)
                except OSError:
                    pass  # the client cut it off
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(folder / "c.pem", folder / "k.pem")
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=pki.client_ca_pem())
    ctx.sni_callback = lambda sock, name, _ctx: names.append(name)
    server = ThreadingHTTPServer((address, 0), Handler)
    server.daemon_threads = True
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield VersionServer(server.server_address[1], names, hosts)
    finally:
        server.shutdown()
        server.server_close()
