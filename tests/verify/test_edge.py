"""Edges: the live Caddyfile is the rendered one and validates; the TLS files are the operator's
and only root and caddy read the keys; from the edge, each donor of each hostname answers over
TLS with the edge's client certificate. Donors: a handshake without a client certificate fails.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import shlex

import pytest
from boxcheck import missing
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, EdgeBox
from donorkit.inventory.paths import pki_dir
from donorkit.render import templates as render


def _on_box_ca(host: Host, data: DonorBox) -> str:
    """A shell prefix that writes our CA (from this machine) to $ca on the box, or uses -k."""
    ca = pki_dir(data) / "ca.crt"
    text = ca.read_text() if ca.is_file() else ""
    return (f"ca=$(mktemp); trap 'rm -f \"$ca\"' EXIT; printf '%s' {shlex.quote(text)} "
            "> \"$ca\"; ") + ("verify=--cacert; " if text else "verify=-k; ca=; ")


def test_edge_caddyfile_is_rendered(edge_host: Host, edge_data: EdgeBox) -> None:
    path = render.CADDYFILE
    if not edge_host.file(path).exists:
        missing(edge_host, f"{path} does not exist")
    live = edge_host.file(path).content_string
    want = render.render_edge_caddyfile(edge_data)
    diff = "".join(difflib.unified_diff(want.splitlines(True), live.splitlines(True),
                                        "rendered from the inventory", path))
    assert live == want, f"{path} differs from the render:\n{diff[:3000]}"


def test_edge_caddy_validate(edge_host: Host) -> None:
    if not edge_host.exists("caddy"):
        missing(edge_host, "caddy is not installed")
    command = ("runuser -u caddy -- caddy validate --adapter caddyfile --config "
               f"{render.CADDYFILE}")
    result = edge_host.run(command)
    assert result.rc == 0, f"`{command}` failed:\n{result.stderr.strip()[-2000:]}"


def test_edge_tls_files(edge_host: Host, edge_data: EdgeBox) -> None:
    """Our CA, the edge's client pair (and its public pair with private_ca): present, the keys
    0640 root:caddy, and each the operator's own file (same bytes as in pki_dir)."""
    paths = render.edge_paths(edge_data)
    wanted = ["ca", "client_cert", "client_key"]
    if edge_data.public_tls == "private_ca":
        wanted += ["public_cert", "public_key"]
    pki = pki_dir(edge_data)
    name = edge_data.edge_name
    local = {"ca": pki / "ca.crt", "client_cert": pki / "edges" / f"{name}.crt",
             "client_key": pki / "edges" / f"{name}.key",
             "public_cert": pki / "hosts" / f"{name}.crt",
             "public_key": pki / "hosts" / f"{name}.key"}
    for what in wanted:
        box_file = edge_host.file(paths[what])
        if not box_file.exists:
            missing(edge_host, f"{paths[what]} does not exist")
        if what.endswith("key"):
            assert (box_file.user, box_file.group, box_file.mode) == ("root", "caddy", 0o640), (
                f"{paths[what]} is {box_file.user}:{box_file.group} {oct(box_file.mode)}")
        if local[what].is_file():
            digest = hashlib.sha256(local[what].read_bytes()).hexdigest()
            assert box_file.sha256sum == digest, f"{paths[what]} is not {local[what]}"
    # Each certificate and its key are a pair (read back to this machine, the operator's, where
    # the key comes from), and the client certificate is the client CA's.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    def public(key_pem: bytes) -> bytes:
        key = serialization.load_pem_private_key(key_pem, None)
        return key.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)

    for cert_what, key_what in (("client_cert", "client_key"), ("public_cert", "public_key")):
        if cert_what not in wanted:
            continue
        cert = x509.load_pem_x509_certificate(edge_host.file(paths[cert_what]).content)
        cert_public = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        assert cert_public == public(edge_host.file(paths[key_what]).content), (
            f"{paths[cert_what]} and {paths[key_what]} are not a pair")
    client_ca = pki / "client-ca.crt"
    if client_ca.is_file():
        x509.load_pem_x509_certificate(edge_host.file(paths["client_cert"]).content
                                       ).verify_directly_issued_by(
            x509.load_pem_x509_certificate(client_ca.read_bytes()))


def test_edge_reaches_donor_with_its_client_certificate(edge_host: Host, edge_data: EdgeBox,
                                                       site: str, upstream: str) -> None:
    """From the edge, as its Caddy does: TLS to the donor verified against our CA, the public
    hostname as SNI and Host, the edge's client certificate; /v1/models lists the checkpoint
    (a 502 means the donor's model is not serving: the handshake worked, the check fails with
    that reason)."""
    if not edge_host.exists("curl"):
        missing(edge_host, "curl is not installed")
    paths = render.edge_paths(edge_data)
    entry = next(s for s in edge_data.sites if s.hostname == site)
    address = next(u.address for u in entry.upstreams if u.donor == upstream)
    ip, _, port = address.rpartition(":")
    command = (f"curl -sS -m 20 -o /dev/stdout -w '\\n%{{http_code}}' --cacert {paths['ca']} "
               f"--cert {paths['client_cert']} --key {paths['client_key']} "
               f"--resolve {site}:{port}:{ip.strip('[]')} "
               f"https://{site}:{port}{edge_data.edge_proxy.health_uri}")
    result = edge_host.run(command)
    assert result.rc == 0, f"{upstream} ({address}) for {site}: {result.stderr.strip()}"
    body, _, code = result.stdout.rpartition("\n")
    if code == "502":
        pytest.fail(f"{upstream}'s model for {site} is not serving (its Caddy answered 502)",
                    pytrace=False)
    assert code == "200", f"{upstream} for {site}: HTTP {code} {body[:200]}"
    assert [m["id"] for m in json.loads(body)["data"]] == [entry.checkpoint]


def test_donor_refuses_a_client_without_certificate(host: Host, data: DonorBox,
                                                    route: str) -> None:
    """Straight to the donor's Caddy with the public hostname, no client certificate: the TLS
    handshake fails and curl never gets an HTTP status. Which error curl reports depends on when
    the server's alert lands (TLS 1.3 asks for the certificate after the handshake): 35 (handshake),
    55 (send: the server already closed) or 56 (receive: "alert bad certificate"); all three seen
    against Caddy 2.6.2 from one client, 55 the most often."""
    port = data.caddy_https_port
    script = (_on_box_ca(host, data) + f"curl -sS -m 20 -o /dev/null -w '%{{http_code}}' "
              f"$verify $ca --resolve {route}:{port}:127.0.0.1 https://{route}:{port}/v1/models")
    result = host.run("/bin/sh -c %s", script)
    assert result.rc in (35, 55, 56) and result.stdout.strip() == "000", (
        f"without a client certificate: curl exit {result.rc}, HTTP {result.stdout.strip()}, "
        f"{result.stderr.strip()}")
