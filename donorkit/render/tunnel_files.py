"""The files of a home donor's tunnel (donorkit/inventory/tunnel_plan.py plans it): each box's
WireGuard config (templates/wireguard.conf.j2: no private key in it, the box sets its own from its
own file), its nftables table (templates/tunnel.nft.j2), a home donor's watch unit, and the
operator's ssh_config that reaches a tunnelled donor through its edge."""

from __future__ import annotations

from pathlib import Path

from donorkit.inventory.host_data import DonorBox, DonorTunnel, EdgeTunnel
from donorkit.render.templates import jinja_environment

KEY_DIR = "/etc/wireguard"
# Our own nftables table on a box: created and replaced whole by tasks/tunnel.py's file, never
# anyone else's rules (Debian's nftables.service flushes the whole ruleset: not used).
NFT_TABLE = "uncloseai_tunnel"


def ssh_config(data: DonorBox) -> str:
    """An ssh_config (pyinfra's `ssh_config_file` host data) for a tunnelled donor: its tunnel
    address through the edge as a ProxyJump, which pyinfra makes with paramiko itself (a
    direct-tcpip channel through the edge's sshd). Not a ProxyCommand: paramiko's ProxyCommand
    counts a partial write to the command's stdin as whole, and under pyinfra's gevent the pipe
    takes partial writes: the stream was corrupted ("Corrupted MAC on input") mid-deploy. The
    edge's entry carries its own key and known_hosts file (an unknown host key refused)."""
    jump = data.ssh_jump_data
    if jump is None:
        raise ValueError(f"donor {data.donor_name} is not reached through an edge")
    alias = f"uncloseai-jump-{data.ssh_jump}"
    lines = [f"# Written by the uncloseai inventory for donor {data.donor_name}: its SSH goes "
             f"through edge {data.ssh_jump}.",
             f"Host {alias}", f"    HostName {jump.ssh_hostname}",
             f"    User {jump.ssh_user}", "    StrictHostKeyChecking yes",
             "    ConnectTimeout 10"]
    if int(jump.ssh_port) != 22:
        # Only when not 22: pyinfra 3.10 passes a hop's Port as the config's string, and
        # paramiko then looks its host key up as "[host]:22", which known_hosts never holds.
        lines.append(f"    Port {jump.ssh_port}")
    if jump.ssh_key:
        lines.append(f"    IdentityFile {_ssh_config_word(jump.ssh_key)}")
    if jump.ssh_known_hosts_file:
        lines.append(f"    UserKnownHostsFile {_ssh_config_word(jump.ssh_known_hosts_file)}")
    lines += [f"Host {data.ssh_hostname}", f"    ProxyJump {alias}",
              "    StrictHostKeyChecking yes", ""]
    return "\n".join(lines)


def _ssh_config_word(path: str) -> str:
    """A path as one ssh_config word (paramiko splits on whitespace; quotes group)."""
    if '"' in path:
        raise ValueError(f"{path!r}: a double quote cannot be in an ssh_config path")
    return f'"{path}"' if any(c.isspace() for c in path) else path


def write_ssh_config(data: DonorBox, directory: Path) -> str:
    """ssh_config(data) in `directory` (made 0700), rewritten only when it differs; its path."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{data.donor_name}.ssh_config"
    text = ssh_config(data)
    if not path.exists() or path.read_text() != text:
        staged = path.with_suffix(".tmp")
        staged.write_text(text)
        staged.replace(path)
    return str(path)


def paths(tunnel: DonorTunnel | EdgeTunnel) -> dict[str, str]:
    """The files of a box's tunnel, all under /etc/wireguard (root only)."""
    return interface_paths(tunnel.interface)


def interface_paths(interface: str) -> dict[str, str]:
    """The files of the tunnel on `interface`."""
    base = f"{KEY_DIR}/{interface}"
    return {"conf": f"{base}.conf", "key": f"{base}.key", "public": f"{base}.pub",
            "nft": f"{base}.nft"}


def unit(tunnel: DonorTunnel | EdgeTunnel) -> str:
    return f"wg-quick@{tunnel.interface}.service"


def render_conf(tunnel: DonorTunnel | EdgeTunnel) -> str:
    return jinja_environment().get_template("wireguard.conf.j2").render(
        tunnel=tunnel, paths=paths(tunnel), nft_table=NFT_TABLE)


WATCH_UNIT = "uncloseai-tunnel-watch.service"


def render_watch_unit(tunnel: DonorTunnel) -> str:
    """A home donor's watch: one ping to each edge through the tunnel every watch_interval s
    (templates/tunnel-watch.service.j2 says why)."""
    return jinja_environment().get_template("tunnel-watch.service.j2").render(
        tunnel=tunnel, unit=unit(tunnel), edges=[peer.address for peer in tunnel.peers])


def render_nft(tunnel: DonorTunnel | EdgeTunnel) -> str:
    return jinja_environment().get_template("tunnel.nft.j2").render(
        tunnel=tunnel, nft_table=NFT_TABLE, edges=[peer.address for peer in tunnel.peers])
