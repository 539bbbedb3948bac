"""OpenSSH's command lines through an edge to a box behind it (a home donor's tunnel address): a
stream (`ssh -W`, a ProxyCommand) and a local forward (`ssh -N -L`). Standard library only:
donorkit/commands/transport.py runs them where pydantic may be absent."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from donorkit.inventory.host_data import EdgeBox, SshJump


def _to_edge(jump: EdgeBox | SshJump) -> list[str]:
    """OpenSSH to the edge with its own SSH data (its key, its known_hosts file; an unknown or
    changed host key refused, never a prompt), up to where the stream's own words go."""
    words = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", "ConnectTimeout=10", "-p", str(jump.ssh_port)]
    if jump.ssh_key:
        words += ["-i", jump.ssh_key, "-o", "IdentitiesOnly=yes"]
    if jump.ssh_known_hosts_file:
        words += ["-o", f"UserKnownHostsFile={jump.ssh_known_hosts_file}"]
    return words


def proxy_command(jump: EdgeBox | SshJump, target: str, port: int) -> list[str]:
    """OpenSSH's `ssh -W target:port` through the edge: one TCP stream on its stdin/stdout."""
    return [*_to_edge(jump), "-W", f"{target}:{port}", f"{jump.ssh_user}@{jump.ssh_hostname}"]


def forward_command(jump: SshJump, local_port: int, target: str, port: int) -> list[str]:
    """OpenSSH's local forward through the edge: 127.0.0.1:local_port here to target:port as
    the edge reaches it (a home donor's tunnel address), no remote command, and an exit when
    the port cannot be bound (`ExitOnForwardFailure`) instead of a session without it."""
    return [*_to_edge(jump), "-N", "-o", "ExitOnForwardFailure=yes",
            "-L", f"127.0.0.1:{int(local_port)}:{target}:{int(port)}",
            f"{jump.ssh_user}@{jump.ssh_hostname}"]
