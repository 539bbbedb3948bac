"""A home donor's join file: `make join-file` writes it on the operator's machine from the inventory
(the edges' endpoints and public keys, the donor's tunnel address, the two ports the edges reach:
nothing secret), signed with the operator's CA key, and prints the CA's fingerprint; `make join`
reads it on the box, as root, bounded (MAX_BYTES, no YAML anchors, MAX_DEPTH), and refuses it in
one line unless it is what this module allows and signed by the CA of that fingerprint. What it
can make the box do is narrow: one WireGuard interface of our own, addresses inside the tunnel
pool, two TCP ports open to the peers only, and packages the owner's own checkout names
(docs/reference.md "A home donor's trust").
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from donorkit.inventory import schema
from donorkit.inventory.fleet import DEFAULTS_FILE, read_yaml
from donorkit.inventory.host_data import DonorBox, DonorTunnel, TunnelPeer
from donorkit.inventory.inventory_files import (
    FleetError,
    YamlLimits,
    check_strings,
    label,
    read_bounded_yaml,
    validate,
)
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.pki import Pki, ca_fingerprint
from donorkit.inventory.schema import TunnelSettings
from donorkit.inventory.tunnel_plan import check_address
from donorkit.inventory.tunnel_values import (
    KeepaliveSeconds,
    TunnelAddress,
    TunnelEndpoint,
    TunnelPool,
    WgInterface,
    WgKey,
)
from donorkit.inventory.values import Name, Port, Strict
from donorkit.render.tunnel_files import interface_paths

# A join file is a few hundred bytes: anything much larger is not one.
MAX_BYTES = 16384
# The deepest a join file nests: the file, `tunnel`, `peers`, one peer.
MAX_DEPTH = 6
# At most this many edges for one donor to dial.
MAX_PEERS = 16
# What the CA key signs: this line, then the file's data as canonical JSON. Not DER, so the
# signature can never pass for one of a certificate (the same key signs those).
SIGNED_PREFIX = b"uncloseai join file v1\n"


def _join_interface(text: str) -> str:
    # The kernel refuses `.` and `..` (wg-quick's pattern allows them); `lo` is the box's own.
    if text in (".", ".."):
        raise ValueError(f"{text!r} is not an interface name the kernel accepts")
    if text == "lo":
        raise ValueError("'lo' is the box's loopback interface, not a tunnel's")
    return text


JoinInterface = Annotated[WgInterface, AfterValidator(_join_interface)]


def _base64(text: str) -> str:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    return text


class JoinPorts(Strict):
    """The two TCP ports the box opens to its edges' tunnel addresses (and nobody else)."""

    caddy: Port                         # its Caddy, which the edges proxy to
    ssh: Port                           # its sshd, which the operator's deploy reaches


class JoinPeer(Strict):
    """An edge the donor dials."""

    name: Name
    public_key: WgKey
    address: TunnelAddress              # its tunnel address: the only AllowedIPs of the peer
    endpoint: Annotated[TunnelEndpoint, Field(max_length=300)]  # host:port the box dials (UDP)


class JoinTunnel(Strict):
    interface: JoinInterface
    pool: TunnelPool                    # every tunnel address lies here (checked below)
    address: TunnelAddress              # the box's own
    keepalive: KeepaliveSeconds
    watch_interval: KeepaliveSeconds
    ports: JoinPorts
    peers: Annotated[list[JoinPeer], Field(min_length=1, max_length=MAX_PEERS)]


class JoinSignature(Strict):
    """The operator's CA certificate and its key's signature of the file's data."""

    ca: Annotated[str, Field(max_length=4096), AfterValidator(_base64)]  # its DER, base64
    value: Annotated[str, Field(max_length=256), AfterValidator(_base64)]


class JoinFile(Strict):
    """A join file (`make join-file` writes it, `make join` reads it on the box)."""

    donor: Name
    tunnel: JoinTunnel
    signature: JoinSignature


def signed_bytes(donor: str, tunnel: JoinTunnel) -> bytes:
    """What the signature covers: SIGNED_PREFIX, then the data as canonical JSON (its meaning,
    not its YAML spelling)."""
    body = {"donor": donor, "tunnel": tunnel.model_dump(mode="json")}
    return SIGNED_PREFIX + json.dumps(body, sort_keys=True, separators=(",", ":"),
                                      ensure_ascii=True).encode()


# ------------------------------------------------------------------ the operator's side -------


def join_tunnel(data: DonorBox) -> JoinTunnel:
    """A tunnelled donor's tunnel as its join file carries it."""
    assert data.tunnel is not None
    tunnel = data.tunnel
    return JoinTunnel.model_validate({
        "interface": tunnel.interface, "pool": data.tunnel_settings.pool,
        "address": tunnel.address, "keepalive": tunnel.keepalive,
        "watch_interval": tunnel.watch_interval,
        "ports": {"caddy": data.caddy_https_port, "ssh": data.ssh_port},
        "peers": [{"name": p.name, "public_key": p.public_key, "address": p.address,
                   "endpoint": p.endpoint} for p in tunnel.peers]})


def operator_pki(data: DonorBox):
    return Pki(pki_dir(data), data.pki_renew_days)


def write_join_file(name: str, fleet: dict[str, DonorBox], out: Path) -> str:
    """Write donor `name`'s join file at `out` (a new file), signed with the operator's CA key;
    the problem in one line, or ''."""
    import yaml

    data = fleet.get(name)
    if data is None or data.reach != "tunnel" or data.tunnel is None:
        return f"{name}: not a donor with reach: tunnel in the donors file"
    waiting = [peer.name for peer in data.tunnel.peers if not peer.public_key]
    dials = {peer.name for peer in data.tunnel.peers}
    missing = sorted(set(data.tunnel_hubs) - dials) + waiting
    if missing or not data.tunnel.peers:
        return (f"{name}: edge(s) {', '.join(missing) or '?'} have no tunnel_public_key yet: "
                "deploy them first (their deploy prints the key to paste)")
    tunnel = join_tunnel(data)
    problem = addresses_problem(tunnel)
    if problem:
        return f"{name}: field '{problem[0]}': {problem[1]}"
    ca, signature = operator_pki(data).sign(signed_bytes(name, tunnel))
    document = JoinFile.model_validate({
        "donor": name, "tunnel": tunnel.model_dump(mode="json"),
        "signature": {"ca": base64.b64encode(ca).decode(),
                      "value": base64.b64encode(signature).decode()}})
    with open(out, "x") as handle:
        handle.write(f"# Join file of donor {name}: on the box, as root: make join "
                     f"JOIN={out.name} FINGERPRINT=<the operator's CA fingerprint> (nothing "
                     "secret here; signed by the operator's CA).\n")
        yaml.safe_dump(document.model_dump(mode="json"), handle, sort_keys=False)
    return ""


# ------------------------------------------------------------------ the box's side ------------


def _bounded_yaml(path: Path) -> Any:
    """The file's YAML document, read bounded by the inventory's reader with a join file's
    limits: a regular file of at most MAX_BYTES, no anchors or aliases, nested at most
    MAX_DEPTH deep, duplicate keys refused; a FleetError otherwise."""
    return read_bounded_yaml(path, YamlLimits(kind="a join file", bytes=MAX_BYTES,
                                              depth=MAX_DEPTH, aliases=0))


# Private by Python's reckoning, but never a tunnel's: routed into the tunnel, they would take
# the box's own loopback or the cloud metadata address (the inventory's pool rule may say it too).
_NOT_A_POOL = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16")


def addresses_problem(tunnel: JoinTunnel) -> tuple[str, str] | None:
    """(field, problem) where the tunnel's addresses leave the pool or repeat, or None: nothing
    outside the tunnel pool is ever routed into the tunnel or let in through it."""
    pool = ipaddress.IPv4Network(tunnel.pool)
    if any(pool.overlaps(ipaddress.IPv4Network(special)) for special in _NOT_A_POOL):
        return "tunnel.pool", (f"{tunnel.pool} overlaps {', '.join(_NOT_A_POOL)} (this host, "
                               "loopback, link-local): not a tunnel's")
    problem = check_address(tunnel.pool, tunnel.address)
    if problem:
        return "tunnel.address", problem
    seen = {tunnel.address: "the box's own tunnel address"}
    names: set[str] = set()
    keys: set[str] = set()
    for index, peer in enumerate(tunnel.peers):
        where = f"tunnel.peers.{index}"
        problem = check_address(tunnel.pool, peer.address)
        if problem:
            return f"{where}.address", problem
        if peer.address in seen:
            return f"{where}.address", f"{peer.address} is also {seen[peer.address]}"
        seen[peer.address] = f"edge {peer.name}'s tunnel address"
        if peer.name in names:
            return f"{where}.name", f"edge {peer.name} is listed twice"
        if peer.public_key in keys:
            return f"{where}.public_key", "another edge has the same public key"
        names.add(peer.name)
        keys.add(peer.public_key)
        host = peer.endpoint.rpartition(":")[0].removeprefix("[").removesuffix("]")
        try:
            inside = ipaddress.ip_address(host) in pool
        except ValueError:
            inside = False
        if inside:
            return f"{where}.endpoint", (f"{host} is inside the tunnel pool {tunnel.pool}: an "
                                         "edge is dialled at its public address")
    if tunnel.ports.caddy == tunnel.ports.ssh:
        return "tunnel.ports.ssh", f"{tunnel.ports.ssh} is also the Caddy port"
    return None


def normalized_fingerprint(text: str) -> str | None:
    """A SHA-256 fingerprint as `make join-file` prints it (64 hex digits), or as openssl does
    (pairs with colons, any case, an optional `sha256:`); None when it is neither."""
    plain = text.strip().lower().removeprefix("sha256:").replace(":", "")
    return plain if re.fullmatch(r"[0-9a-f]{64}", plain) else None


def read_join_file(path: Path, fingerprint: str) -> JoinFile:
    """The join file, checked whole, or a FleetError in one line naming the file and the field:
    bounded YAML, every string by the inventory's rule, the strict model above, the addresses
    inside the pool, then signed by the CA whose certificate has `fingerprint`."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    expected = normalized_fingerprint(fingerprint or "")
    if expected is None:
        raise FleetError(f"{path}: FINGERPRINT {label(fingerprint or '')}: not a SHA-256 "
                         "fingerprint (64 hex digits, as the operator's `make join-file` "
                         "prints it)")
    doc = _bounded_yaml(path)
    if not isinstance(doc, dict):
        raise FleetError(f"{path}: must be a mapping (donor, tunnel, signature), "
                         f"got {type(doc).__name__}")
    check_strings(doc, path)
    if "signature" not in doc:
        raise FleetError(f"{path}: not signed (no field 'signature'): use the join file the "
                         "operator's `make join-file` wrote, unchanged")
    donor = doc.get("donor")
    where = f"{path}: donor '{label(donor)}'" if isinstance(donor, str) else str(path)
    join = validate(JoinFile, doc, where, known=JoinFile.model_fields)
    problem = addresses_problem(join.tunnel)
    if problem:
        raise FleetError(f"{where}: field '{problem[0]}': {problem[1]}")
    try:
        ca = x509.load_der_x509_certificate(base64.b64decode(join.signature.ca))
        actual = ca.fingerprint(hashes.SHA256()).hex()
    except ValueError:
        raise FleetError(f"{where}: field 'signature.ca': not a certificate") from None
    if actual != expected:
        raise FleetError(f"{where}: field 'signature.ca': signed by the CA with fingerprint "
                         f"{actual}, not the operator's {expected} (FINGERPRINT): not from "
                         "the operator you got the fingerprint from")
    key = ca.public_key()
    try:
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise InvalidSignature
        key.verify(base64.b64decode(join.signature.value),
                   signed_bytes(join.donor, join.tunnel), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise FleetError(f"{where}: field 'signature.value': does not match the file's "
                         "contents: it was changed after the operator signed it") from None
    return join


def donor_tunnel(join: JoinFile, settings: TunnelSettings) -> DonorTunnel:
    """The join file's tunnel as the typed data tasks/tunnel.py reads, with the packages of the
    owner's own checkout (`settings`: its defaults.yml `tunnel`), never the file's. Its public
    key is what the join prints, not known yet."""
    tunnel = join.tunnel
    return DonorTunnel.model_construct(
        role="donor", entry=f"donor '{join.donor}'", interface=tunnel.interface,
        address=tunnel.address, keepalive=tunnel.keepalive,
        watch_interval=tunnel.watch_interval, public_key=None,
        peers=[TunnelPeer.model_construct(**peer.model_dump()) for peer in tunnel.peers],
        allowed_ports=[tunnel.ports.caddy, tunnel.ports.ssh],
        packages=list(settings.packages), userspace_package=settings.userspace_package,
        handshake_max_age=settings.handshake_max_age)


def summary(join: JoinFile, settings: TunnelSettings) -> str:
    """What joining does to the box, for its owner to read before it does it."""
    tunnel = join.tunnel
    edges = "; ".join(f"{p.name} at {p.endpoint} (tunnel address {p.address})"
                      for p in tunnel.peers)
    return (f"join: donor {join.donor}, signed by the operator's CA: WireGuard interface "
            f"{tunnel.interface} (config /etc/wireguard/{tunnel.interface}.conf, a new file "
            f"of ours), address {tunnel.address}/32 in the pool {tunnel.pool}; dials {edges}; "
            f"TCP {tunnel.ports.caddy} (Caddy) and {tunnel.ports.ssh} (sshd) open to those "
            "tunnel addresses only; installs "
            f"{', '.join(settings.packages)} (and {settings.userspace_package} where the kernel "
            "has no WireGuard)")


def box_lines(join: JoinFile) -> str:
    """What the owner sends the operator after joining: the box's tunnel key and its SSH host
    key at its tunnel address (public keys: nothing secret)."""
    tunnel = join.tunnel
    public = Path(interface_paths(tunnel.interface)["public"]).read_text().strip()
    host_keys = sorted(Path("/etc/ssh").glob("ssh_host_ed25519_key.pub"))
    lines = [f"tunnel_public_key: {public}"]
    for key in host_keys:
        kind, blob = key.read_text().split()[:2]
        lines.append(f"known_hosts: {tunnel.address} {kind} {blob}")
    return "\n".join(lines)


def local_tunnel_settings() -> TunnelSettings:
    """The owner's own checkout's defaults.yml `tunnel` (its packages; never the join file's)."""
    return validate(schema.Defaults, read_yaml(DEFAULTS_FILE), str(DEFAULTS_FILE)).tunnel


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m donorkit.commands.join_file", description=(
        "join-file DONOR OUT: write a home donor's signed join file (operator's machine); "
        "check JOIN --fingerprint FP: check it and say what joining does (on the box); "
        "box-keys JOIN --fingerprint FP: print the joined box's public keys for the operator"))
    parser.add_argument("action", choices=["join-file", "check", "box-keys"])
    parser.add_argument("args", nargs="+")
    parser.add_argument("--fingerprint", default="")
    args = parser.parse_args(argv)
    if args.action == "join-file":
        from donorkit.box.inventory_groups import inventory_or_exit
        if len(args.args) != 2:
            parser.error("join-file DONOR OUT")
        fleet, _ = inventory_or_exit(require_local_sources=False, require_revisions=False)
        out = Path(args.args[1])
        if out.exists():
            print(f"join-file: {out} already exists", file=sys.stderr)
            return 2
        problem = write_join_file(args.args[0], fleet, out)
        if problem:
            print(f"join-file: {problem}", file=sys.stderr)
            return 2
        fingerprint = ca_fingerprint(operator_pki(fleet[args.args[0]]).ca_pem())
        print(f"join-file: wrote {out}, signed by your CA (fingerprint {fingerprint}). Give "
              "the box's owner the file, and the fingerprint another way (it is the same for "
              "every join file: publish it); on the box, as root: "
              f"make join JOIN={out.name} FINGERPRINT={fingerprint}")
        return 0
    if len(args.args) != 1:
        parser.error(f"{args.action} JOIN --fingerprint FP")
    try:
        join = read_join_file(Path(args.args[0]), args.fingerprint)
        settings = local_tunnel_settings()
    except FleetError as exc:
        print(f"join error: {exc}", file=sys.stderr)
        return 2
    if args.action == "check":
        print(summary(join, settings))
        return 0
    print("Send these lines to the network's operator (public keys, nothing secret):")
    print(box_lines(join))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
