"""Edge Caddy: one public site per hostname this edge serves, proxying to every donor routing it
(over TLS, verified against our CA, with the edge's client certificate), load-balanced with
health checks; the rate limit when the inventory sets one. A Caddy without the rate-limit
module is refused before its config is touched; a new config is validated (as the caddy user)
before it replaces the live one."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_operations import caddy_has_module
from donorkit.inventory.host_data import this_box
from donorkit.render.caddy_config import caddy_config
from donorkit.render.templates import render_edge
from pyinfra_declared.apt import apt_install


@deploy("Edge Caddy")
def apply() -> None:
    # curl: the verification suite checks each donor from the edge with it.
    apt_install(name="Install Caddy", packages=["caddy", "curl"], lock_wait=host.data.apt_lock_wait)

    if host.data.rate_limit:
        caddy_has_module(
            name="Check that Caddy has the rate-limit module",
            module="http.handlers.rate_limit",
            why="the inventory's rate_limit for this edge",
            how=("install a Caddy built with github.com/mholt/caddy-ratelimit (`xcaddy build "
                 "--with github.com/mholt/caddy-ratelimit`, or `caddy add-package "
                 "github.com/mholt/caddy-ratelimit` on the box), or set `rate_limit: null` on this "
                 "edge in donors.yml (no rate limit)"),
        )

    caddy_config(
        render_edge(this_box(host)),
        install_root=host.data.install_root,
        tls_dir=host.data.caddy_tls_dir,
        access_log=host.data.caddy_access_log,
    )
