"""WireGuard tunnel (donorkit/inventory/tunnel_plan.py): a home donor behind NAT dials the edges
serving its hostnames, each edge the hub of its donors. On every box of a tunnel: first a check
that the interface's config and name are not someone else's (never replaced), then the tools,
wireguard-go where the kernel has no module, the box's own key pair (the private key never
leaves it), its public key checked against the inventory's, the config (no private key in it)
and the tunnel's firewall table, then wg-quick@<interface> running them. A changed config is
applied with `wg syncconf` (tunnel_running): tunnels up stay up, the operator's SSH through
them too."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.tunnel_operations import (
    firewall_loaded,
    tunnel_is_ours,
    tunnel_key_is,
    tunnel_running,
    userspace_wireguard,
    wireguard_key,
)
from donorkit.render import tunnel_files
from donorkit.render.templates import UNIT_DIR, VERIFY_UNIT
from pyinfra_declared.apt import apt_install
from pyinfra_declared.files import ConfigFile, config_files
from pyinfra_declared.services import service_running_its_files


@deploy("WireGuard tunnel")
def apply() -> None:
    # A DonorTunnel or EdgeTunnel (donorkit/inventory/host_data.py): the inventory's, or the join
    # file's (inventory/join.py).
    tunnel = host.data.tunnel
    files = tunnel_files.paths(tunnel)
    state = f"{host.data.install_root}/state"
    conf_marker, nft_marker = f"{state}/tunnel.reload-pending", f"{state}/tunnel.nft-pending"
    # Only ever our own tunnel: a config file or an interface of that name that is not ours (the
    # owner's own wg0) stops the box here, before anything is installed or written.
    tunnel_is_ours(name="Check the tunnel's interface is not someone else's", conf=files["conf"],
                   interface=tunnel.interface)
    apt_install(name="Install WireGuard's tools and nftables", packages=tunnel.packages,
                lock_wait=host.data.apt_lock_wait)
    userspace_wireguard(name="Install WireGuard in user space where the kernel has none",
                        package=tunnel.userspace_package, lock_wait=host.data.apt_lock_wait)
    wireguard_key(name="Make the box's WireGuard key pair", private_key=files["key"],
                  public_key=files["public"])
    # Joining (`make join` on the box) prints the key for the operator: nothing to compare yet.
    if not host.data.get("tunnel_joining"):
        tunnel_key_is(name="Check the box's tunnel key against the inventory",
                      public_key=files["public"], expected=tunnel.public_key,
                      entry=tunnel.entry)
    config_files(
        name="Install the tunnel's firewall and config",
        files=[ConfigFile(content=tunnel_files.render_nft(tunnel), dest=files["nft"], mode="600",
                          validate="nft -c -f {path}", pending_marker=nft_marker),
               ConfigFile(content=tunnel_files.render_conf(tunnel), dest=files["conf"], mode="600",
                          pending_marker=conf_marker)],
    )
    tunnel_running(name=f"Run the tunnel ({tunnel_files.unit(tunnel)})",
                   unit=tunnel_files.unit(tunnel), interface=tunnel.interface,
                   private_key=files["key"],
                   pending_marker=conf_marker)
    firewall_loaded(name="Load the tunnel's firewall", nft_file=files["nft"],
                    table=tunnel_files.NFT_TABLE, pending_marker=nft_marker)
    if tunnel.role == "donor":
        # The donor is the only side that can dial: it pings its edges through the tunnel, so
        # an edge that lost the session gets a new handshake within seconds.
        watch = f"{UNIT_DIR}/{tunnel_files.WATCH_UNIT}"
        config_files(name="Install the tunnel watch",
                     files=[ConfigFile(content=tunnel_files.render_watch_unit(tunnel), dest=watch,
                                       validate=VERIFY_UNIT)])
        service_running_its_files(name="Run the tunnel watch", unit=tunnel_files.WATCH_UNIT,
                                  depends_on=[watch], record=f"{state}/tunnel-watch.started")
