"""The tunnel's value types, as the schema checks them: a WireGuard key, an interface name, the
private pool, an address in it, a keepalive, an edge's endpoint (host:port). donorkit/inventory/
tunnel_plan.py plans the tunnel with them."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator, Field

from donorkit.inventory.values import SshHost


def _wg_key(text: str) -> str:
    """A WireGuard public key: base64 of 32 bytes (what `wg pubkey` prints)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(text) != 44 or len(raw) != 32:
        raise ValueError(f"{text!r} is not a WireGuard public key (44 characters of base64, "
                         "what `wg pubkey` prints)")
    if base64.b64encode(raw).decode() != text:
        # The last digit's two low bits are not part of the key: another spelling of the same
        # 32 bytes would pass as a second key (and never match what the box's `wg pubkey` says).
        raise ValueError(f"{text!r} is not how `wg pubkey` writes a key (its last digit before "
                         f"'=' is not canonical: {base64.b64encode(raw).decode()!r} is the key)")
    return text


WgKey = Annotated[str, AfterValidator(_wg_key)]


# Names the kernel has or treats apart ("lo"; "all" and "default" are the sysctl folders of every
# interface, net.ipv4.conf.all), and "." / "..", which the kernel refuses (dev_valid_name).
RESERVED_INTERFACES = frozenset({"lo", "all", "default", ".", ".."})


def _interface(text: str) -> str:
    """An interface name the kernel, wg-quick and systemd all take: within IFNAMSIZ (1-15
    characters), letters, digits and `_.-` only (wg-quick would also take `=` and `+`, but
    `wg-quick@<it>.service` is then no unit name systemd accepts), starting with a letter, digit
    or `_` (never an option's `-`), none of RESERVED_INTERFACES."""
    if text == "lo":
        raise ValueError("'lo' is the box's loopback interface, not a tunnel's")
    if not re.fullmatch(r"[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,14}", text) \
            or text in RESERVED_INTERFACES:
        raise ValueError(f"{text!r} is not an interface name the kernel, wg-quick and systemd "
                         "all take (1-15 of letters, digits and _.-, starting with a letter, "
                         "digit or _; not lo, all, default)")
    return text


WgInterface = Annotated[str, AfterValidator(_interface)]


# Where a tunnel pool may lie: the private ranges of RFC 1918, and nothing else. Python's
# `is_private` also says yes to loopback (127/8), link-local (169.254/16: the cloud metadata
# address), "this network" (0/8), documentation and reserved space (240/4): a hub routes its
# whole pool into the tunnel, so each of those would take traffic meant for something else.
PRIVATE_POOLS = tuple(ipaddress.IPv4Network(n)
                      for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
_SPECIAL = (("loopback", "is_loopback"), ("link-local (the cloud metadata address's range)",
                                          "is_link_local"),
            ("multicast", "is_multicast"), ("reserved", "is_reserved"))


def _pool(text: str) -> str:
    try:
        network = ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not an IPv4 network (a.b.c.d/len, host bits 0): "
                         f"{exc}") from None
    if not any(network.subnet_of(private) for private in PRIVATE_POOLS):
        kind = next((word for word, test in _SPECIAL if getattr(network, test)),
                    "'this network' (0.0.0.0/8)" if network.network_address.packed[0] == 0
                    else "public or special-purpose space")
        raise ValueError(f"{text!r}: the tunnel pool must be a private IPv4 network (inside "
                         f"10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16), not {kind}")
    if network.prefixlen > 28:
        raise ValueError(f"{text!r}: the tunnel pool must be a private IPv4 network of /28 or "
                         "larger")
    return text


TunnelPool = Annotated[str, AfterValidator(_pool)]


def _address(text: str) -> str:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an IPv4 address") from None
    return text


TunnelAddress = Annotated[str, AfterValidator(_address)]
KeepaliveSeconds = Annotated[int, Field(ge=1, le=600)]


def _endpoint(text: str) -> str:
    """host:port (an IPv6 address in brackets), the host as the inventory's ssh_host."""
    from pydantic import TypeAdapter

    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port")
    TypeAdapter(SshHost).validate_python(host.removeprefix("[").removesuffix("]"))
    return text


TunnelEndpoint = Annotated[str, AfterValidator(_endpoint)]
