"""The tunnel's facts and operations on a box (tasks/tunnel.py calls them): WireGuard in user
space where the kernel lacks the module, the box's own key pair, its public key against the
inventory's, and the tunnel's nftables table loaded. Each yields no command when the box already
matches; commands quote every value."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FactBase

from pyinfra_declared.apt import APT_FUNCTIONS, _apt_get
from pyinfra_declared.batched_facts import DebStatus, PathStates, TextFiles, UnitState
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote


class KernelWireguard(FactBase):
    """Whether the running kernel has WireGuard (loaded, or a module it can load)."""

    def command(self) -> str:
        return ("if [ -d /sys/module/wireguard ] || modprobe -nq wireguard 2>/dev/null; "
                "then echo yes; else echo no; fi")

    def process(self, output: list[str]) -> bool:
        return output == ["yes"]

    def default(self) -> bool:
        return False


class NftTable(FactBase):
    """Whether an nftables table exists (`nft list table`)."""

    def command(self, family: str, table: str) -> str:
        return (f"if nft list table {q(family)} {q(table)} >/dev/null 2>&1; then echo yes; "
                "else echo no; fi")

    def process(self, output: list[str]) -> bool:
        return output == ["yes"]

    def default(self) -> bool:
        return False


# The first line of every tunnel config the deploy writes (templates/wireguard.conf.j2): a config
# that does not start with it is someone else's.
CONF_MARKER = "# Managed by the uncloseai deploy"


class TunnelOwnership(FactBase):
    """Whose the tunnel's config file and interface are: `conf` is absent, ours (it starts with
    CONF_MARKER) or theirs (any other file, a link, a directory); `interface` whether a network
    interface of that name exists. Reads the file's first bytes only: an owner's WireGuard
    config holds their private key, which never leaves their box."""

    def command(self, conf: str, interface: str) -> str:
        c, marker = q(conf), q(CONF_MARKER)
        return (f"if [ ! -e {c} ] && [ ! -L {c} ]; then echo conf=absent; "
                f"elif [ -f {c} ] && [ ! -L {c} ] && "
                f"[ \"$(head -c {len(CONF_MARKER)} {c})\" = {marker} ]; then echo conf=ours; "
                "else echo conf=theirs; fi; "
                f"if [ -e /sys/class/net/{q(interface)} ]; then echo interface=yes; "
                "else echo interface=no; fi")

    def process(self, output: list[str]) -> dict[str, str]:
        return dict(line.split("=", 1) for line in output if "=" in line)

    def default(self) -> dict[str, str]:
        return {}


@operation(found=lambda op: need(TunnelOwnership, conf=op.conf, interface=op.interface))
def tunnel_is_ours(conf: str, interface: str, found: dict):
    """Refuse the box when the tunnel's config file is someone else's, or when a network
    interface of its name exists without our config (the owner's wg0, `lo`, `eth0`): the
    deploy and `make join` only ever add their own tunnel, never replace what the box has."""
    if found.get("conf") == "theirs":
        fail(f"{conf} exists and is not the uncloseai deploy's (it does not start with "
             f"'{CONF_MARKER}'): left as it is; the tunnel needs a name of its own (the operator's "
             "tunnel.interface)")
    if found.get("interface") == "yes" and found.get("conf") != "ours":
        fail(f"a network interface named {interface} exists on this box and is not the "
             "uncloseai tunnel's: left as it is; the tunnel needs a name of its own (the "
             "operator's tunnel.interface)")
    host.noop(f"{interface} is the tunnel's own" if found.get("conf") == "ours"
              else f"no {interface} on the box yet")


@operation(kernel=lambda op: need(KernelWireguard),
           installed=lambda op: need(DebStatus, packages=[op.package]))
def userspace_wireguard(package: str, kernel: bool, installed: set[str], lock_wait: int = 600):
    """`package` (wireguard-go) installed where the kernel has no WireGuard: wg-quick runs it by
    itself there. Nothing where the kernel has it."""
    if kernel or package in installed:
        host.noop("the kernel has WireGuard" if kernel else f"{package} installed")
        return
    yield APT_FUNCTIONS + _apt_get(lock_wait, "update -q", f"install -y -q {q(package)}")


@operation(found=lambda op: need(PathStates, paths=[op.private_key, op.public_key]))
def wireguard_key(private_key: str, public_key: str, found: dict):
    """The box's own key pair: made here once (`wg genkey`, 0600 root), never read by the deploy
    or sent anywhere; its public half beside it (0644). A key pair already there is kept."""
    if found.get(private_key, {}).get("type", "").startswith("regular") and \
            found.get(public_key, {}).get("type", "").startswith("regular"):
        host.noop("the box has its key pair")
        return
    key, pub = q(private_key), q(public_key)
    yield (f"umask 077 && [ -s {key} ] || {{ wg genkey > {key}.tmp && mv {key}.tmp {key}; }} "
           f"&& wg pubkey < {key} > {pub}.tmp && chmod 644 {pub}.tmp && mv {pub}.tmp {pub}")


@operation(found=lambda op: need(TextFiles, paths=[op.public_key]))
def tunnel_key_is(public_key: str, expected: str | None, entry: str, found: dict):
    """Refuse the box when its public key is not the inventory's `tunnel_public_key` (`entry`
    names where to paste it): a box joined again has a new key the edges do not know yet."""
    lines = found.get(public_key) or []
    actual = lines[0].strip() if lines else None
    if actual is None:
        fail(f"no tunnel key on the box yet ({public_key})")
    if expected is None:
        fail(f"its tunnel key is {actual}: add `tunnel_public_key: {actual}` to {entry} in the "
             "donors file and deploy again (a public key: nothing secret)")
    if actual != expected:
        fail(f"its tunnel key is {actual}, but the inventory's tunnel_public_key for {entry} is "
             f"{expected}: the box was joined again? Put its key in the donors file")
    host.noop("the box's tunnel key is the inventory's")


@operation(marker=lambda op: need(PathStates, paths=[op.pending_marker]),
           loaded=lambda op: need(NftTable, family="inet", table=op.table))
def firewall_loaded(nft_file: str, table: str, pending_marker: str, marker: dict, loaded: bool):
    """The tunnel's nftables table as its file says: loaded when the file changed (its marker)
    or the table is gone (`nft -f` replaces the table in one transaction)."""
    if loaded and pending_marker not in marker:
        host.noop(f"table inet {table} is loaded")
        return
    yield f"nft -f {q(nft_file)} && rm -f {q(pending_marker)}"


def sync_command(interface: str, private_key: str) -> str:
    """The running interface made to match its config file (`wg syncconf`: peers added or
    removed, the sessions of the others kept). wg-quick's own reload (`wg syncconf` of the
    stripped config) would also remove the private key, which is not in the file: it is put in
    a private copy on /run's tmpfs (never an argument, never on disk), removed after."""
    iface, key = q(interface), q(private_key)
    return (f"( t=$(umask 077 && mktemp /run/uncloseai-wg.XXXXXX) && "
            f"wg-quick strip {iface} | awk -v keyfile={key} "
            "'{ print } /^\\[Interface\\]$/ && !done { getline k < keyfile; "
            "print \"PrivateKey = \" k; done = 1 }' > \"$t\" && "
            f"wg syncconf {iface} \"$t\"; rc=$?; rm -f \"$t\"; exit $rc )")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, present=op.pending_marker))
def tunnel_running(unit: str, interface: str, private_key: str, pending_marker: str,
                   unit_state: dict):
    """wg-quick@<interface> enabled and running its config: started when it is not running; a
    changed config (its marker) applied to the running interface with sync_command, never a
    restart (the tunnels up stay up, the operator's SSH through one of them too)."""
    q_marker = q(pending_marker)
    if unit_state.get("UnitFileState") != "enabled":
        yield f"systemctl enable -q {q(unit)}"
    if unit_state.get("ActiveState") != "active":
        yield f"systemctl restart {q(unit)} && rm -f {q_marker}"
    elif unit_state.get("Present") == "yes":
        yield f"{sync_command(interface, private_key)} && rm -f {q_marker}"
    else:
        host.noop(f"{unit} is running its config")
