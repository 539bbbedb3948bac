"""HTTPS from this machine (the operator's) to a donor's Caddy with an edge's client
certificate: donors answer nobody else, and an edge's key never goes to a donor box, so checks
that need an answer through a donor's Caddy make the request from here."""

from __future__ import annotations

import http.client
import socket
import ssl
from pathlib import Path

from donorkit.paths import pki_dir
from donorkit.pki import OPERATOR_CLIENT, Pki


def edge_client_pair(data: dict) -> tuple[Path, Path] | None:
    """The client certificate and key, in this machine's PKI folder, of an edge the donor trusts
    (a current edge: fleet.py's `trusted_clients`, less the operator's own, OPERATOR_CLIENT,
    which a donor gives more: /metrics), or None."""
    for name in data["trusted_clients"]:
        if name == OPERATOR_CLIENT:
            continue
        cert = pki_dir(data) / "edges" / f"{name}.crt"
        if cert.is_file() and cert.with_suffix(".key").is_file():
            return cert, cert.with_suffix(".key")
    return None


def operator_client_pair(data: dict) -> tuple[Path, Path]:
    """The operator's own client certificate and key (issued here if missing, as `make accept`
    does)."""
    return Pki(pki_dir(data)).client_pair(OPERATOR_CLIENT)


def ca_file(data: dict) -> Path | None:
    ca = pki_dir(data) / "ca.crt"
    return ca if ca.is_file() else None


class _Pinned(http.client.HTTPSConnection):
    """HTTPS to `address` with `hostname` as SNI and Host (a donor's sites are picked by both)."""

    def __init__(self, hostname: str, address: str, port: int, **kwargs: object) -> None:
        super().__init__(hostname, port, **kwargs)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def get(address: str, port: int, hostname: str, path: str, ca: Path | None,
        client: tuple[Path, Path] | None, timeout: float = 60) -> tuple[int, str]:
    """GET https://hostname:port/path from `address`, verified against `ca` (our CA), with the
    client pair if given; (status, body). TLS and connection errors are raised."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if client:
        context.load_cert_chain(str(client[0]), str(client[1]))
    connection = _Pinned(hostname, address, port, context=context, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()
