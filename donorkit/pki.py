"""The private CA on the operator's machine, and one server certificate per donor box.

The edge verifies GPU boxes against this CA (Caddy's `tls internal` could not be verified by it).
The CA key never leaves this machine; keys are written 0600.
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

CA_DAYS = 3650
SERVER_DAYS = 365


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


class PkiError(Exception):
    """The CA on this machine is not usable as it is; the message says what to do."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Pki:
    """A CA in `directory` (created on first use) issuing server certificates."""

    def __init__(self, directory: Path | str, renew_days: int = 30) -> None:
        self.directory = Path(directory)
        self.renew_days = renew_days
        self.ca_cert_path = self.directory / "ca.crt"
        self.ca_key_path = self.directory / "ca.key"

    def check(self) -> None:
        """Raise PkiError when the CA pair is half there (run before any connection)."""
        have_cert, have_key = self.ca_cert_path.exists(), self.ca_key_path.exists()
        if have_cert != have_key:
            present, absent = ((self.ca_cert_path, self.ca_key_path) if have_cert
                               else (self.ca_key_path, self.ca_cert_path))
            raise PkiError(f"{present} exists but {absent} does not: restore it (a new CA "
                           "would break the edge's trust in every donor); nothing was written")

    def _ensure_ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        self.check()
        if self.ca_cert_path.exists():
            cert = x509.load_pem_x509_certificate(self.ca_cert_path.read_bytes())
            key = serialization.load_pem_private_key(self.ca_key_path.read_bytes(), None)
            return cert, key
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "uncloseai donor CA")])
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
        _create_exclusive(self.ca_key_path, _key_pem(key), 0o600)
        _create_exclusive(self.ca_cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert, key

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
        key = ec.generate_private_key(ec.SECP256R1())
        # The names are in the SAN (what clients check); a CN holds at most 64 characters, so a
        # longer (valid, up to 253) hostname is not put there: the donor's name is.
        common_name = next((h for h in hostnames if len(h) <= 64), donor[:64])
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=SERVER_DAYS))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.DNSName(h) for h in hostnames]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_private(key_path, _key_pem(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cert_path.read_text(), key_path.read_text()
