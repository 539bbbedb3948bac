"""Edge Caddy: one public site per hostname this edge serves, proxying to every donor routing it
(over TLS, verified against our CA, with the edge's client certificate), load-balanced with
health checks; the rate limit when the inventory sets one. A Caddy without the rate-limit
module is refused before its config is touched; a new config is validated (as the caddy user)
before it replaces the live one."""

from pyinfra import host

from donorkit.operations import caddy_has_module
from donorkit.render import CADDY_DROP_IN, CADDYFILE, render_edge
from pyinfra_snapshot.operations import (
    apt_install,
    config_file,
    directories,
    owned_file,
    reloaded_service,
)

reload_marker = f"{host.data.install_root}/state/caddy.reload-pending"
restart_marker = f"{host.data.install_root}/state/caddy.restart-pending"

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

directories(name="Create the TLS directory", paths=[host.data.caddy_tls_dir], group="caddy",
            mode="750")
# `caddy validate` opens the log file: as root it would create it root-owned, locking caddy out.
owned_file(name="Create the access log", path=host.data.caddy_access_log, user="caddy",
           group="caddy", mode="640")

for rendered in render_edge(host.data.dict()):
    is_caddyfile = rendered.path == CADDYFILE
    config_file(
        name=f"Install {rendered.path}",
        content=rendered.content,
        dest=rendered.path,
        mode=rendered.mode,
        user=rendered.user,
        group=rendered.group,
        validate=("runuser -u caddy -- caddy validate --adapter caddyfile --config {path} "
                  ">/dev/null" if is_caddyfile else None),
        pending_marker=restart_marker if rendered.path == CADDY_DROP_IN else reload_marker,
    )
reloaded_service(name="Restart Caddy on its new unit settings", unit="caddy",
                 pending_marker=restart_marker, restart=True)
reloaded_service(name="Run Caddy with the current config", unit="caddy",
                 pending_marker=reload_marker)
