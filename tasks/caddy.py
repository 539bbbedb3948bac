"""GPU-side Caddy: one TLS site per public hostname routed here, each proxying to its own model's
loopback port. A new config is validated (as the caddy user) before it replaces the live one."""

from pyinfra import host

from donorkit.render import CADDY_DROP_IN, CADDYFILE, drain_flag, render_host
from pyinfra_snapshot.operations import (
    absent_path,
    apt_install,
    config_file,
    directories,
    owned_file,
    reloaded_service,
)

reload_marker = f"{host.data.install_root}/state/caddy.reload-pending"
# A changed unit drop-in (the admin socket's directory) needs a restart, not a reload.
restart_marker = f"{host.data.install_root}/state/caddy.restart-pending"

apt_install(name="Install Caddy", packages=["caddy"], lock_wait=host.data.apt_lock_wait)

directories(name="Create the TLS directory", paths=[host.data.caddy_tls_dir], group="caddy",
            mode="750")
# `caddy validate` opens the log file: as root it would create it root-owned, locking caddy out.
owned_file(name="Create the access log", path=host.data.caddy_access_log, user="caddy",
           group="caddy", mode="640")

for rendered in render_host(host.data.dict()):
    if not rendered.path.startswith(("/etc/caddy/", CADDY_DROP_IN)):
        continue
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
# After the Caddyfile: a Caddy restarted on the old config would still serve its admin API on
# TCP, where `caddy reload` (which reads the new config's admin address) cannot reach it.
reloaded_service(name="Restart Caddy on its new unit settings", unit="caddy",
                 pending_marker=restart_marker, restart=True)
reloaded_service(name="Run Caddy with the current config", unit="caddy",
                 pending_marker=reload_marker)
# Last: every unit of the box passed its readiness gate, so it may take traffic again. The
# rolling rollout (donorkit/rollout.py) creates this flag to take the box out of the edges' pools
# before its run; any run that gets here puts it back (an interrupted rollout converges).
absent_path(name="Put the box back in the edges' pools", path=drain_flag(host.data.dict()))
