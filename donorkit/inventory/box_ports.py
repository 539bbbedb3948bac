"""Two services of one box on one TCP port: refused from the inventory, before any deploy (the
second would fail to bind at its start, or take the first's traffic). A donor's sshd
(`ssh_port`), its Caddy (`caddy_https_port`, on every address of a direct donor) and its models
(`models.<m>.port`, on loopback: sshd listens on every address, loopback included); an edge's
sshd and its Caddy (`edge_https_port`, and port 80 for ACME's HTTP listener). The tunnel's own
port is UDP (no TCP service shares it). donorkit.inventory.fleet calls these with each box's data
once merged; schema.check_box already keeps a donor's models off each other's and Caddy's ports."""

from __future__ import annotations

from donorkit.inventory.host_data import DonorBox, EdgeBox

# Caddy serves plain HTTP on this port (and, with ACME, listens there for the redirect and the
# HTTP challenge): never a port for a TLS site, never another service's on an ACME edge.
CADDY_HTTP_PORT = 80


def donor_port_problem(box: DonorBox) -> tuple[str, str] | None:
    """(field, problem) for the first two of a donor's services on one port, or None."""
    taken = {box.caddy_https_port: "caddy_https_port"}
    for model in box.models.values():
        taken.setdefault(model.port, f"models.{model.name}.port")
    if box.ssh_port in taken:
        return "ssh_port", (f"port {box.ssh_port} is also {taken[box.ssh_port]} on this box "
                            "(sshd and it cannot share a port)")
    return None


def edge_port_problem(box: EdgeBox) -> tuple[str, str] | None:
    """(field, problem) for the first two of an edge's services on one port, or None."""
    if box.ssh_port == box.edge_https_port:
        return "ssh_port", (f"port {box.ssh_port} is also edge_https_port on this box (sshd "
                            "and Caddy cannot share a port)")
    if box.public_tls == "acme" and box.ssh_port == CADDY_HTTP_PORT:
        return "ssh_port", (f"port {CADDY_HTTP_PORT} is where Caddy answers ACME's HTTP "
                            "challenge and redirects to HTTPS on an acme edge")
    return None
