"""The private CAs on the operator's machine: `ca.crt`/`ca.key` issues each donor's server
certificate (and an edge's public one where edge_public_tls is private_ca); `client-ca.crt`/
`client-ca.key` issues one client certificate per edge and the operator's own (OPERATOR_CLIENT).
A donor accepts only the current edges' and the operator's leaves of the client CA
(render.trusted_client_files): a deleted edge loses access at the donors' next deploy. Two CAs,
so no certificate a donated box holds can open another donor (docs/reference.md "The data
files"). The CA keys never leave this machine; every key is written 0600 and goes only to its host.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from donorkit.inventory.errors import DonorsError

CA_DAYS = 3650
SERVER_DAYS = 365
# The operator's own client certificate (pki_dir/edges/operator-accept.*): `make accept`, the
# verification suite and the benchmarks present it to a donor's Caddy; every donor trusts it.
OPERATOR_CLIENT = "operator-accept"
# Client certificates the operator's own tools present to donors (OPERATOR_CLIENT, and
# bench/rollout.py's bench-watcher), issued under edges/ as an edge's are: no edge may be named
# like one (or anything operator-*), or it would share the operator's pair.
OPERATOR_CLIENT_NAMES = (OPERATOR_CLIENT, "bench-watcher")


def is_operator_client(name: str) -> bool:
    return name in OPERATOR_CLIENT_NAMES or name.startswith("operator-")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    """Write a key 0600 from the start (never world-readable, not even briefly), atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Create a CA file that must not exist yet (O_EXCL): a CA file is never overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def ca_fingerprint(pem: str) -> str:
    """A CA certificate's SHA-256 fingerprint (of its DER bytes: what `openssl x509 -noout
    -fingerprint -sha256 -in ca.crt` prints), as 64 lowercase hex digits."""
    return x509.load_pem_x509_certificate(pem.encode()).fingerprint(hashes.SHA256()).hex()


class PkiError(DonorsError):
    """The CA on this machine is not usable as it is; the message says what to do."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Pki:
    """The CAs in `directory` (created on first use) and the certificates they issue."""

    def __init__(self, directory: Path | str, renew_days: int = 30) -> None:
        self.directory = Path(directory)
        self.renew_days = renew_days
        self.ca_cert_path = self.directory / "ca.crt"
        self.ca_key_path = self.directory / "ca.key"
        self.client_ca_cert_path = self.directory / "client-ca.crt"
        self.client_ca_key_path = self.directory / "client-ca.key"

    def check(self) -> None:
        """Raise PkiError when a CA pair is half there (run before any connection)."""
        for cert_path, key_path, breaks in (
                (self.ca_cert_path, self.ca_key_path, "the edge's trust in every donor"),
                (self.client_ca_cert_path, self.client_ca_key_path,
                 "every donor's trust in the edges")):
            have_cert, have_key = cert_path.exists(), key_path.exists()
            if have_cert != have_key:
                present, absent = ((cert_path, key_path) if have_cert else (key_path, cert_path))
                raise PkiError(f"{present} exists but {absent} does not: restore it (a new CA "
                               f"would break {breaks}); nothing was written")

    def _ensure_ca(self, client: bool = False) -> tuple[x509.Certificate,
                                                        ec.EllipticCurvePrivateKey]:
        self.check()
        cert_path, key_path = ((self.client_ca_cert_path, self.client_ca_key_path) if client
                               else (self.ca_cert_path, self.ca_key_path))
        if cert_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            return cert, key
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        title = "uncloseai edge client CA" if client else "uncloseai donor CA"
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, title)])
        cert = (x509.CertificateBuilder()
                .subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        # Key first: a run that dies between the two leaves a key and no cert, which stops the
        # next run with the message above instead of minting a second CA.
        _create_exclusive(key_path, _key_pem(key), 0o600)
        _create_exclusive(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert, key

    def client_ca_pem(self) -> str:
        """The client CA's certificate (created with its key on first use): donors trust it."""
        self._ensure_ca(client=True)
        return self.client_ca_cert_path.read_text()

    def ca_pem(self) -> str:
        self._ensure_ca()
        return self.ca_cert_path.read_text()

    def sign(self, data: bytes) -> tuple[bytes, bytes]:
        """(the donor CA's certificate, DER, and an ECDSA-SHA256 signature of `data` by its
        key): how a
        join file shows it is the operator's (donorkit/commands/join_file.py). The CA key signs
        certificates too, whose signed part is DER (it starts with byte 0x30): `data` must not,
        so no signature made here can pass for a certificate's (callers prefix their text)."""
        if data[:1] == b"\x30":
            raise ValueError("refusing to sign DER-like data with the CA key")
        cert, key = self._ensure_ca()
        return (cert.public_bytes(serialization.Encoding.DER),
                key.sign(data, ec.ECDSA(hashes.SHA256())))

    def client_cert(self, edge: str, renew: bool = True) -> tuple[str, str]:
        """(cert PEM, key PEM) of `edge`'s client certificate from the client CA, issued anew
        only when the CA, the name or the expiry (pki_renew_days) demand, like server_cert.

        Donors trust exactly the leaf certificates they were given (trusted_pems), so a renewal
        must reach the donors before the client presents it: a donor's render renews (and its
        Caddy trusts the new and the previous certificate, kept as `<name>.prev.crt` until it
        expires); an edge's render passes renew=False and keeps presenting its certificate until
        it has expired, so deploying an edge alone never locks it out of the donors."""
        ca, ca_key = self._ensure_ca(client=True)
        edge_dir = self.directory / "edges"
        edge_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cert_path, key_path = edge_dir / f"{edge}.crt", edge_dir / f"{edge}.key"
        if cert_path.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            try:
                cert.verify_directly_issued_by(ca)
                issued = True
            except (InvalidSignature, ValueError, TypeError):
                issued = False
            names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
            margin = dt.timedelta(days=self.renew_days if renew else 0)
            if issued and names == [edge[:64]] and cert.not_valid_after_utc - _now() > margin:
                return cert_path.read_text(), key_path.read_text()
            if issued and names == [edge[:64]] and cert.not_valid_after_utc > _now():
                _write_public(edge_dir / f"{edge}.prev.crt", cert_path.read_bytes())
        return _issue_leaf(ca, ca_key, edge[:64], ExtendedKeyUsageOID.CLIENT_AUTH, [],
                           cert_path, key_path)

    def trusted_pems(self, name: str) -> list[str]:
        """The certificates of client `name` a donor accepts: its current one (issued or renewed
        as client_cert does) and, until it expires, the one it replaced (the edge may still
        present it: edges are deployed after donors, or alone)."""
        pems = [self.client_cert(name)[0]]
        prev = self.directory / "edges" / f"{name}.prev.crt"
        if prev.exists():
            cert = x509.load_pem_x509_certificate(prev.read_bytes())
            if cert.not_valid_after_utc > _now():
                pems.append(prev.read_text())
        return pems

    def client_pair(self, name: str) -> tuple[Path, Path]:
        """Paths of `name`'s client certificate and key under edges/ (issued or kept as by
        client_cert): for the operator's own checks through a donor's Caddy, which answers only
        the client CA's certificates (`make accept`, the testbed, the benchmarks)."""
        self.client_cert(name)
        return self.directory / "edges" / f"{name}.crt", self.directory / "edges" / f"{name}.key"

    def _is_current(self, cert: x509.Certificate, ca: x509.Certificate,
                    hostnames: list[str]) -> bool:
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            cert.verify_directly_issued_by(ca)
        except (x509.ExtensionNotFound, InvalidSignature, ValueError, TypeError):
            return False
        remaining = cert.not_valid_after_utc - _now()
        return (sorted(sans.get_values_for_type(x509.DNSName)) == sorted(hostnames)
                and remaining > dt.timedelta(days=self.renew_days))

    def server_cert(self, donor: str, hostnames: list[str]) -> tuple[str, str]:
        """(cert PEM, key PEM) for `donor`, issued anew only when hostnames, CA or expiry demand."""
        ca, ca_key = self._ensure_ca()
        host_dir = self.directory / "hosts"
        host_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cert_path, key_path = host_dir / f"{donor}.crt", host_dir / f"{donor}.key"
        if cert_path.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            if self._is_current(cert, ca, hostnames):
                return cert_path.read_text(), key_path.read_text()
        # The names are in the SAN (what clients check); a CN holds at most 64 characters, so a
        # longer (valid, up to 253) hostname is not put there: the donor's name is.
        common_name = next((h for h in hostnames if len(h) <= 64), donor[:64])
        san = x509.SubjectAlternativeName([x509.DNSName(h) for h in hostnames])
        return _issue_leaf(ca, ca_key, common_name, ExtendedKeyUsageOID.SERVER_AUTH, [san],
                           cert_path, key_path)


def _issue_leaf(ca: x509.Certificate, ca_key, common_name: str, usage: x509.ObjectIdentifier,
                extensions: list[x509.ExtensionType], cert_path: Path,
                key_path: Path) -> tuple[str, str]:
    """A new key and a certificate for it from `ca` (SERVER_DAYS, not a CA, one extended key
    usage, `extensions` non-critical), written to the paths; returns (cert PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(_now() - dt.timedelta(minutes=5))
               .not_valid_after(_now() + dt.timedelta(days=SERVER_DAYS)))
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    cert = (builder
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path.read_text(), key_path.read_text()
