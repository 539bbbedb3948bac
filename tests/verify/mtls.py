"""HTTPS from this machine (the operator's) to a donor's Caddy with an edge's client
certificate: donors answer nobody else, and an edge's key never goes to a donor box, so checks
that need an answer through a donor's Caddy make the request from here."""

from __future__ import annotations

from pathlib import Path

from donorkit.commands import transport
from donorkit.inventory.host_data import DonorBox
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki


def edge_client_pair(data: DonorBox) -> tuple[Path, Path] | None:
    """The client certificate and key, in this machine's PKI folder, of an edge the donor trusts
    (a current edge: fleet.py's `trusted_clients`, less the operator's own, OPERATOR_CLIENT,
    which a donor gives more: /metrics), or None."""
    for name in data.trusted_clients:
        if name == OPERATOR_CLIENT:
            continue
        cert, key = transport.edge_client_pair(data, name)
        if cert.is_file() and key.is_file():
            return cert, key
    return None


def operator_client_pair(data: DonorBox) -> tuple[Path, Path]:
    """The operator's own client certificate and key (issued here if missing, as `make accept`
    does)."""
    return Pki(pki_dir(data)).client_pair(OPERATOR_CLIENT)


def ca_file(data: DonorBox) -> Path | None:
    ca = transport.ca_file(data)
    return ca if ca.is_file() else None


def get(address: str, port: int, hostname: str, path: str, ca: Path | None,
        client: tuple[Path, Path] | None, timeout: float = 60,
        proxy: list[str] | None = None) -> tuple[int, str]:
    """GET https://hostname:port/path from `address` (donorkit.commands.transport.https_get; a home
    donor's through its edge: `proxy`, its data's caddy_proxy_command)."""
    return transport.https_get(address, port, hostname, path, ca, client, timeout,
                               proxy=proxy)
