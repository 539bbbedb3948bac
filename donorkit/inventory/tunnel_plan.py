"""Home donors behind NAT: WireGuard between a donor (`reach: tunnel`) and the edges serving its
hostnames, each edge the hub of its tunnelled donors. Decided from the inventory alone (no host
is asked): each box's tunnel address (its entry's, or derived from its name: a hash into
`tunnel.pool`, the same every run, none alike), which edges a donor dials and which donors each
edge carries (those whose `tunnel_public_key` was pasted), how this machine reaches a donor
through its edge (SSH `-W`, a local forward for `make accept`), and what its join file holds.
Files a box gets: donorkit/render/tunnel_files.py; key pairs are made on each box (tasks/tunnel.py).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress

from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import (
    DonorBox,
    DonorTunnel,
    EdgeBox,
    EdgeTunnel,
    SshJump,
    TunnelPeer,
)
from donorkit.inventory.ssh_commands import proxy_command
from donorkit.inventory.values import box_identity


class TunnelError(DonorsError):
    """A mistake in the tunnel data: (where, field, problem), turned into one line by fleet.py."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        super().__init__(f"{where}: field '{field}': {problem}")
        self.where, self.field, self.problem = where, field, problem


def derived_address(pool: str, name: str) -> str:
    """The address a name gets in the pool when its entry sets none: sha256 of the name onto the
    pool's host addresses (never the network or broadcast address). Stable: adding or removing
    another box never moves it."""
    network = ipaddress.IPv4Network(pool)
    hosts = network.num_addresses - 2
    index = 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % hosts
    return str(network.network_address + index)


def check_address(pool: str, address: str) -> str | None:
    """Why `address` cannot be a box's tunnel address in `pool`, or None."""
    network = ipaddress.IPv4Network(pool)
    ip = ipaddress.IPv4Address(address)
    if ip not in network:
        return f"{address} is not inside the tunnel pool {pool}"
    if ip in (network.network_address, network.broadcast_address):
        which = "network" if ip == network.network_address else "broadcast"
        return f"{address} is the pool's {which} address"
    return None


def endpoint(host: str, port: int) -> str:
    """host:port as WireGuard's Endpoint reads it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def plan(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox], where: dict[str, str]) -> None:
    """Give every tunnelled donor and every hub edge its `tunnel` data, or raise TunnelError.
    The boxes are frozen models: each one that changes is replaced in its dict by a copy with
    its tunnel fields (`model_copy(update=...)`: the values are made here from validated data).
    `where` names each host's entry for the message ("donors.yml: donor 'x'"). Before this, a
    box holds `reach` (donors), `tunnel_address` (its entry's, or None), `tunnel_public_key`
    (pasted by the operator, or None), `tunnel_settings` and, on an edge, `tunnel_endpoint`."""

    tunnelled = {name: box for name, box in fleet.items() if box.reach == "tunnel"}
    if not tunnelled:
        return
    taken: dict[str, str] = {}
    hubs: dict[str, list[str]] = {edge: [] for edge in edges}
    dials: dict[str, list[str]] = {}
    for name, box in sorted(tunnelled.items()):
        hostnames = {route.hostname for route in box.routes}
        serving = sorted(edge for edge, ebox in edges.items()
                         if hostnames & {site.hostname for site in ebox.sites})
        if not serving:
            raise TunnelError(where[name], "reach", "a tunnelled donor is reached only through "
                              "an edge, and no edge serves its hostnames "
                              f"({', '.join(sorted(hostnames))})")
        dials[name] = serving
        for edge in serving:
            hubs[edge].append(name)
    members: list[tuple[str, DonorBox | EdgeBox]] = [
        *sorted(tunnelled.items()), *((e, edges[e]) for e in sorted(hubs) if hubs[e])]
    _check_pool_size(members, where)
    addresses: dict[str, str] = {}
    for name, box in members:
        pool = box.tunnel_settings.pool
        field = "tunnel_address"
        address = box.tunnel_address or derived_address(pool, name)
        problem = check_address(pool, address)
        if problem:
            raise TunnelError(where[name], field, problem)
        if address in taken:
            raise TunnelError(where[name], field, (
                f"{address} is also the tunnel address of {taken[address]}"
                + ("" if box.tunnel_address else
                   " (derived from both names): set tunnel_address on one of them")))
        taken[address] = where[name].rsplit(": ", 1)[-1]
        addresses[name] = address
    pools = {box.tunnel_settings.pool for _, box in members}
    if len(pools) > 1:
        name = sorted(tunnelled)[0]
        raise TunnelError(where[name], "overrides.tunnel.pool",
                          f"one tunnel pool for the whole fleet, not {', '.join(sorted(pools))}")
    _check_routing(fleet, edges, hubs, addresses, where)
    for edge, donors in hubs.items():
        if not donors:
            continue
        ebox = edges[edge]
        settings = ebox.tunnel_settings
        network = ipaddress.IPv4Network(settings.pool)
        edges[edge] = ebox.model_copy(update={
            "tunnel_address": addresses[edge],
            "tunnel": EdgeTunnel.model_construct(
                role="edge",
                entry=f"edge '{edge}'",
                interface=settings.interface,
                address=addresses[edge],
                prefixlen=network.prefixlen,
                listen_port=settings.port,
                public_key=ebox.tunnel_public_key,
                # A donor whose key the operator has not pasted yet has not joined: no peer.
                peers=[TunnelPeer.model_construct(
                    name=donor, public_key=fleet[donor].tunnel_public_key,
                    address=addresses[donor], endpoint=None)
                    for donor in donors if fleet[donor].tunnel_public_key],
                waiting=[donor for donor in donors if not fleet[donor].tunnel_public_key],
                packages=list(settings.packages),
                userspace_package=settings.userspace_package,
                handshake_max_age=settings.handshake_max_age,
            )})
    for name, box in tunnelled.items():
        settings = box.tunnel_settings
        address = addresses[name]
        peers = [TunnelPeer.model_construct(
            name=edge, public_key=edges[edge].tunnel_public_key, address=addresses[edge],
            # The port the edge listens on: its own settings' (an edge's overrides may move it).
            endpoint=endpoint(edges[edge].tunnel_endpoint, edges[edge].tunnel_settings.port))
            for edge in dials[name]]
        # The operator's machine reaches the box at its tunnel address, through the first edge
        # of its hubs that has joined the tunnel (SSH -W: a TCP stream through the edge's sshd).
        jump = next((edges[edge] for edge in dials[name] if edges[edge].tunnel_public_key),
                    edges[dials[name][0]])
        fleet[name] = box.model_copy(update={
            "tunnel_address": address,
            "tunnel_hubs": dials[name],
            "tunnel": DonorTunnel.model_construct(
                role="donor",
                entry=f"donor '{name}'",
                interface=settings.interface,
                address=address,
                keepalive=settings.keepalive,
                watch_interval=settings.watch_interval,
                public_key=box.tunnel_public_key,
                # An edge whose key the operator has not pasted yet (its first deploy prints
                # it) cannot be dialled: left out until it has one.
                peers=[peer for peer in peers if peer.public_key],
                allowed_ports=[box.caddy_https_port, box.ssh_port],
                packages=list(settings.packages),
                userspace_package=settings.userspace_package,
                handshake_max_age=settings.handshake_max_age,
            ),
            "ssh_hostname": address,
            "ssh_proxy_command": proxy_command(jump, address, box.ssh_port),
            # ... and its Caddy (make status, the rollout's checks), through the same edge.
            "caddy_proxy_command": proxy_command(jump, address, box.caddy_https_port),
            "ssh_jump": jump.edge_name,
            "ssh_jump_data": SshJump.model_construct(
                ssh_hostname=jump.ssh_hostname, ssh_port=jump.ssh_port,
                ssh_user=jump.ssh_user, ssh_key=jump.ssh_key,
                ssh_known_hosts_file=jump.ssh_known_hosts_file),
        })


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an address (box_identity's spelling: IPv4-mapped IPv6 as IPv4, localhost as
    127.0.0.1), or None for a hostname (not resolved: nothing is asked of the network here)."""
    try:
        return ipaddress.ip_address(box_identity(host))
    except ValueError:
        return None


def undialable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """An edge's endpoint no donor could dial it at: loopback (each donor would dial itself) or
    link-local (its own network's, or the metadata service)."""
    return ip.is_loopback or ip.is_link_local


def _entry(where: dict[str, str], name: str) -> str:
    return where[name].rsplit(": ", 1)[-1]


def _check_pool_size(members: list[tuple[str, DonorBox | EdgeBox]],
                     where: dict[str, str]) -> None:
    """A pool with fewer host addresses than the tunnel has boxes: refused as such (not as the
    collision of two derived addresses that would follow)."""
    pools = {box.tunnel_settings.pool for _, box in members}
    if len(pools) != 1:
        return                        # plan's own check: one pool for the whole fleet
    pool = pools.pop()
    hosts = ipaddress.IPv4Network(pool).num_addresses - 2
    if len(members) > hosts:
        raise TunnelError(where[members[0][0]], "tunnel.pool", (
            f"{pool} is too small: {hosts} addresses for the tunnel's {len(members)} boxes "
            "(its donors and hub edges); choose a larger pool"))


def _check_routing(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox],
                   hubs: dict[str, list[str]], addresses: dict[str, str],
                   where: dict[str, str]) -> None:
    """What each end of the tunnel would reach is the box meant, or TunnelError:
    - no tunnel address (given or derived) is another box's own address (a direct donor's or
      an edge's ssh_host, whatever the order of the entries or the spelling of the address);
    - no edge's tunnel endpoint (where its donors dial it) is another box, a tunnel address,
      inside the pool, loopback or link-local;
    - no box's own address lies inside the pool: each hub routes the whole pool into the
      tunnel, so traffic for that box would go there instead."""
    network = ipaddress.IPv4Network(next(iter(fleet[n] for n in fleet
                                              if fleet[n].reach == "tunnel")).tunnel_settings.pool)
    boxes: dict[str, str] = {}        # box_identity of each box's own address -> its name
    for name, box in [*((n, b) for n, b in fleet.items() if b.reach == "direct"),
                      *edges.items()]:
        boxes.setdefault(box_identity(box.ssh_hostname), name)
    for name, address in addresses.items():
        other = boxes.get(address)
        if other is not None and other != name:
            raise TunnelError(where[name], "tunnel_address", (
                f"{address} is also the address of {_entry(where, other)} (its ssh_host): the "
                "tunnel would take its traffic (choose another tunnel_address or pool)"))
    tunnel_addresses = {ipaddress.ip_address(a): n for n, a in addresses.items()}
    for name, box in edges.items():   # an edge no tunnelled donor needs yet: its own, if set
        if name in addresses or not box.tunnel_address:
            continue
        ip = ipaddress.ip_address(box.tunnel_address)
        other = tunnel_addresses.get(ip)
        owner = _entry(where, other) if other else (
            f"{_entry(where, boxes[str(ip)])} (its ssh_host)" if str(ip) in boxes else None)
        if owner:
            raise TunnelError(where[name], "tunnel_address",
                              f"{ip} is also the address of {owner}")
    for name, box in edges.items():
        field = ("ssh_host" if box_identity(box.tunnel_endpoint) == box_identity(box.ssh_hostname)
                 else "tunnel_endpoint")
        if field == "ssh_host" and not hubs.get(name):
            continue                  # not dialled by anyone: its ssh_host is checked below
        problem = None
        other = boxes.get(box_identity(box.tunnel_endpoint))
        ip = _ip(box.tunnel_endpoint)
        if other is not None and other != name:
            problem = f"is the address of {_entry(where, other)}: its donors would dial that box"
        elif ip in tunnel_addresses:
            whose = ("its own tunnel address" if tunnel_addresses[ip] == name else
                     f"the tunnel address of {_entry(where, tunnel_addresses[ip])}")
            problem = f"is {whose}: the donors would dial into the tunnel itself"
        elif ip is not None and ip in network:
            problem = (f"is inside the tunnel pool {network}: the donors would dial into the "
                       "tunnel itself")
        elif ip is not None and undialable(ip):
            problem = ("is loopback or link-local: each donor would dial itself or its own "
                       "network, not this edge")
        if problem:
            raise TunnelError(where[name], field, f"{box.tunnel_endpoint} {problem} (the "
                              "edge's tunnel_endpoint, or its ssh_host when it has none, is "
                              "where its donors dial it)")
    for name, box in [*((n, b) for n, b in fleet.items() if b.reach == "direct"),
                      *edges.items()]:
        ip = _ip(box.ssh_hostname)
        if ip is not None and ip in network:
            raise TunnelError(where[name], "ssh_host", (
                f"{box.ssh_hostname} is inside the tunnel pool {network}: every hub routes the "
                "whole pool into the tunnel, so traffic for this box would go there (choose a "
                "pool apart from the boxes' addresses)"))


def check_keys(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox],
               where: dict[str, str]) -> None:
    """One WireGuard key, one peer: two boxes pasted with one key (two donors, a donor and an
    edge, two edges) would each take the other's tunnel traffic. Compared as the 32 bytes."""
    seen: dict[bytes, str] = {}
    for name, box in [*fleet.items(), *edges.items()]:
        if not box.tunnel_public_key:
            continue
        raw = base64.b64decode(box.tunnel_public_key)
        if raw in seen:
            raise TunnelError(where[name], "tunnel_public_key", (
                f"{box.tunnel_public_key} is also the key of {_entry(where, seen[raw])}: one "
                "key, one box (paste what `wg pubkey` printed on this box)"))
        seen[raw] = name


def check_tunnel_ports(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox],
                       entries: dict[str, dict], where: dict[str, str]) -> None:
    """`tunnel.port` is the port a hub edge listens on; a donor dials each of its edges on the
    edge's own (plan). A donor whose own `overrides` set another port would mean a tunnel
    nobody listens on: refused, naming the edge. `entries`: the donors file's donor entries
    (validated), for what each donor's own overrides say."""
    for name, box in fleet.items():
        own = entries[name].get("overrides", {}).get("tunnel", {})
        if box.tunnel is None or "port" not in own:
            continue
        for edge in box.tunnel_hubs:
            listens = edges[edge].tunnel_settings.port
            if listens != own["port"]:
                raise TunnelError(where[name], "overrides.tunnel.port", (
                    f"{own['port']}, but edge '{edge}' listens on {listens}: tunnel.port is "
                    "the hub edges' listen port, and a donor dials each edge on its own (set "
                    "it on the edge or file-wide, not on the donor)"))
