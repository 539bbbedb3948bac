"""The testbed's own network: a bridge on this machine, one namespace + veth per host, NAT out.

Every name here is the testbed's own (prefix `uc`), so teardown can find and delete exactly what
the testbed made even when its state file is lost.
"""

from __future__ import annotations

from pathlib import Path

from .common import WORK, have, log, run

BRIDGE = "ucbr0"
GATEWAY = "10.213.0.1"
SUBNET = "10.213.0.0/24"
NFT_TABLE = "uncloseai_testbed"
NETNS_PREFIX = "ucb-"
VETH_PREFIX = "ucv"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# The value before the first `up`, kept apart from the state file and never overwritten until
# restored: a crashed or repeated `up` cannot make 1 look like the machine's own setting.
IP_FORWARD_SAVED = WORK / "ip_forward.orig"


def netns_name(host: str) -> str:
    return f"{NETNS_PREFIX}{host}"


def veth_name(ip: str) -> str:
    """Host-side veth, named by the address's last octet: unique, and within IFNAMSIZ (15)."""
    return f"{VETH_PREFIX}{ip.rsplit('.', 1)[1]}"


def bridge_up() -> None:
    if run(["ip", "link", "show", BRIDGE], check=False, quiet=True).returncode != 0:
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "replace", f"{GATEWAY}/24", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def nat_up() -> None:
    """Masquerade the test subnet in our own nft table, with forwarding on (old value saved)."""
    if not IP_FORWARD_SAVED.exists():
        IP_FORWARD_SAVED.parent.mkdir(parents=True, exist_ok=True)
        IP_FORWARD_SAVED.write_text(IP_FORWARD.read_text())
    IP_FORWARD.write_text("1\n")
    run(["nft", "delete", "table", "ip", NFT_TABLE], check=False, quiet=True)
    rules = (f"table ip {NFT_TABLE} {{\n"
             "  chain postrouting {\n"
             "    type nat hook postrouting priority srcnat; policy accept;\n"
             f"    ip saddr {SUBNET} oifname != \"{BRIDGE}\" masquerade\n"
             "  }\n}\n")
    run(["nft", "-f", "-"], input=rules)


def host_net_up(host: str, ip: str) -> str:
    """A namespace for one host: its own loopback, eth0 on the bridge, default route via us."""
    ns, veth = netns_name(host), veth_name(ip)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", veth, "master", BRIDGE, "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", GATEWAY])
    return ns


# A home network behind its router: the same private subnet in every home (that is NAT's point).
HOME_SUBNET_PREFIX = "192.168.77"
HOME_ROUTER_TABLE = "home_router"


def router_netns(host: str) -> str:
    return netns_name(f"{host}-r")


def home_net_up(host: str, router_ip: str) -> tuple[str, str]:
    """A home box behind NAT: a router namespace on the bridge at `router_ip` that masquerades
    the home network (192.168.77.0/24) and forwards nothing new into it; the box's namespace has
    192.168.77.2 and a default route via the router, nothing else. Nothing on the test network
    (this machine and the edge included) has a route to the box: it only dials out.
    Returns (the box's namespace, its address)."""
    ns, home = netns_name(host), f"{HOME_SUBNET_PREFIX}.2"
    router = host_net_up(f"{host}-r", router_ip)  # the router: a host on the bridge (router_netns)
    run(["ip", "netns", "add", ns])
    run(["ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
         "netns", ns])
    run(["ip", "-n", router, "addr", "add", f"{HOME_SUBNET_PREFIX}.1/24", "dev", "lan0"])
    run(["ip", "-n", router, "link", "set", "lan0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "addr", "add", f"{home}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", f"{HOME_SUBNET_PREFIX}.1"])
    run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    rules = (f"table ip {HOME_ROUTER_TABLE} {{\n"
             "  chain postrouting {\n"
             "    type nat hook postrouting priority srcnat; policy accept;\n"
             "    oifname \"eth0\" masquerade\n  }\n"
             "  chain forward {\n"
             "    type filter hook forward priority filter; policy drop;\n"
             "    iifname \"lan0\" accept\n"
             "    ct state established,related accept\n  }\n}\n")
    run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules)
    return ns, home


def our_netns() -> list[str]:
    if not have("ip"):  # no iproute2 here: no namespace of ours can exist
        return []
    out = run(["ip", "netns", "list"], check=False, quiet=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NETNS_PREFIX)]


def netns_pids(ns: str) -> list[int]:
    if not have("ip"):
        return []
    out = run(["ip", "netns", "pids", ns], check=False, quiet=True).stdout
    return [int(p) for p in out.split()]


def our_links() -> list[str]:
    if not have("ip"):
        return []
    out = run(["ip", "-o", "link", "show"], check=False, quiet=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n == BRIDGE or (n.startswith(VETH_PREFIX) and n[3:].isdigit())]


def teardown() -> None:
    """Delete namespaces, veths, bridge and nft table; restore ip_forward. Safe when none exist,
    and a no-op for what cannot exist yet: without `ip` or `nft` (a fresh machine, before `up`
    installed them) there are no namespaces, links or nft tables of ours."""
    for ns in our_netns():
        run(["ip", "netns", "delete", ns], check=False)
    for link in our_links():  # deleting a namespace drops its veth pair; this catches the rest
        run(["ip", "link", "delete", link], check=False)
    if have("nft") and run(["nft", "list", "table", "ip", NFT_TABLE], check=False,
                           quiet=True).returncode == 0:
        run(["nft", "delete", "table", "ip", NFT_TABLE], check=False)
    if IP_FORWARD_SAVED.exists():
        old = IP_FORWARD_SAVED.read_text().strip()
        IP_FORWARD.write_text(f"{old}\n")
        IP_FORWARD_SAVED.unlink()
        log(f"net.ipv4.ip_forward restored to {old}")
