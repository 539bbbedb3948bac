"""A home donor's join file (donorkit/tunnel.py plans the tunnel): `make join-file` writes it on
the operator's machine from the inventory (edges' endpoints and public keys, the donor's tunnel
address: nothing secret); `make join` reads and validates it on the box (inventory/join.py) and
prints the box's public keys for the operator to paste.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from donorkit.tunnel import (
    KeepaliveSeconds,
    TunnelAddress,
    TunnelEndpoint,
    WgInterface,
    WgKey,
    interface_paths,
)
from donorkit.values import DebPackage, Name, Port, Strict, Text

if TYPE_CHECKING:
    from donorkit.host_data import DonorBox


def join_document(data: DonorBox) -> dict[str, Any]:
    """The join file of a tunnelled donor (written on the operator's machine, run on the box):
    the donor's own tunnel data, nothing secret (public keys, addresses, ports)."""
    assert data.tunnel is not None
    return {"donor": data.donor_name, "tunnel": data.tunnel.model_dump(
        include=set(JoinTunnel.model_fields))}


class JoinPeer(Strict):
    name: Name
    public_key: WgKey
    address: TunnelAddress
    endpoint: TunnelEndpoint


class JoinTunnel(Strict):
    role: Literal["donor"]
    entry: Text
    interface: WgInterface
    address: TunnelAddress
    keepalive: KeepaliveSeconds
    watch_interval: KeepaliveSeconds
    peers: Annotated[list[JoinPeer], Field(min_length=1)]
    allowed_ports: Annotated[list[Port], Field(min_length=1)]
    packages: list[DebPackage]
    userspace_package: DebPackage
    handshake_max_age: Annotated[int, Field(ge=30, le=3600)]


class JoinFile(Strict):
    """A join file (`make join-file` writes it, `make join` reads it on the box)."""

    donor: Name
    tunnel: JoinTunnel


def read_join_file(path: Path) -> dict:
    """The join file's tunnel data, validated, or one line naming the file and the field."""
    from pydantic import ValidationError

    from donorkit.inventory_files import FleetError, _field, read_yaml

    doc = read_yaml(path)
    try:
        model = JoinFile.model_validate(doc)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise FleetError(f"{path}: field '{_field(error['loc'])}': "
                         f"{error['msg'].removeprefix('Value error, ')}") from None
    return model.model_dump()


def write_join_file(name: str, fleet: dict[str, DonorBox], out: Path) -> str:
    """Write donor `name`'s join file at `out` (a new file); the problem in one line, or ''."""
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
    document = join_document(data)
    JoinFile.model_validate(document)
    with open(out, "x") as handle:
        handle.write(f"# Join file of donor {name}: run `sudo make join JOIN={out.name}` on the "
                     "box (nothing secret here).\n")
        yaml.safe_dump(document, handle, sort_keys=False)
    return ""


def box_lines(join: dict) -> str:
    """What the owner sends the operator after joining: the box's tunnel key and its SSH host
    key at its tunnel address (public keys: nothing secret)."""
    tunnel = join["tunnel"]
    public = Path(interface_paths(tunnel["interface"])["public"]).read_text().strip()
    host_keys = sorted(Path("/etc/ssh").glob("ssh_host_ed25519_key.pub"))
    lines = [f"tunnel_public_key: {public}"]
    for key in host_keys:
        kind, blob = key.read_text().split()[:2]
        lines.append(f"known_hosts: {tunnel['address']} {kind} {blob}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m donorkit.tunnel_join", description=(
        "join-file DONOR OUT: write a home donor's join file (operator's machine); "
        "box-keys JOIN: print the joined box's public keys for the operator (on the box)"))
    parser.add_argument("action", choices=["join-file", "box-keys"])
    parser.add_argument("args", nargs="+")
    args = parser.parse_args(argv)
    from donorkit.fleet import FleetError

    if args.action == "join-file":
        from donorkit.inventory import inventory_or_exit

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
        print(f"join-file: wrote {out}: give it to the box's owner with this checkout; on the "
              f"box, as root: make join JOIN={out.name}")
        return 0
    try:
        join = read_join_file(Path(args.args[0]))
    except FleetError as exc:
        print(f"join error: {exc}", file=sys.stderr)
        return 2
    print("Send these lines to the network's operator (public keys, nothing secret):")
    print(box_lines(join))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
