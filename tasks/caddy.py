"""GPU-side Caddy: one TLS site per public hostname routed here, each proxying to its own model's
loopback port. A new config is validated (as the caddy user) before it replaces the live one."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.inventory.host_data import this_box
from donorkit.render.caddy_config import caddy_config
from donorkit.render.templates import drain_flag, render_caddy
from pyinfra_declared.apt import apt_install
from pyinfra_declared.files import absent_path


@deploy("GPU-side Caddy")
def apply() -> None:
    apt_install(name="Install Caddy", packages=["caddy"], lock_wait=host.data.apt_lock_wait)

    box = this_box(host)
    # Caddy's files (its TLS pair, client CA, drop-in, Caddyfile); tasks/units.py installs the
    # vLLM units.
    caddy_config(
        render_caddy(box),
        install_root=host.data.install_root,
        tls_dir=host.data.caddy_tls_dir,
        access_log=host.data.caddy_access_log,
    )
    # Last: every unit of the box passed its readiness gate, so it may take traffic again. The
    # rolling rollout (donorkit/commands/rollout.py) creates this flag to take the box out of the
    # edges' pools before its run; any run that gets here puts it back (an interrupted rollout
    # converges).
    absent_path(name="Put the box back in the edges' pools", path=drain_flag(box))
