"""The edge's canary: the runner and its config, its service and timer (a round every
`canary.interval`), and caddy.service's drop-in that sends every reload and start through the
runner's filter (donorkit/render/canary_files.py says what each file is). After the edge's Caddy:
the caddy user and Caddy's admin socket exist then."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.inventory.host_data import this_box
from donorkit.render.canary_files import CANARY_DROP_IN, CANARY_SERVICE, CANARY_TIMER, render_canary
from donorkit.render.templates import UNIT_DIR, VERIFY_UNIT
from pyinfra_declared.apt import apt_install
from pyinfra_declared.files import ConfigFile, config_files
from pyinfra_declared.services import reloaded_service, service_running_its_files


@deploy("Edge canary")
def apply() -> None:
    install_root = host.data.install_root
    drop_in_marker = f"{install_root}/state/caddy.canary-pending"
    units = (f"{UNIT_DIR}/{CANARY_SERVICE}", f"{UNIT_DIR}/{CANARY_TIMER}")
    files = render_canary(this_box(host))
    # The runner is the system's Python, standard library only (`python3 -I -S`).
    apt_install(name="Install Python (the canary runner's)", packages=["python3"],
                lock_wait=host.data.apt_lock_wait)
    config_files(
        name="Install the canary runner, its config, service, timer and Caddy's drop-in",
        files=[ConfigFile(content=f.content, dest=f.path, mode=f.mode, user=f.user,
                          group=f.group,
                          validate=VERIFY_UNIT if f.path in units else None,
                          pending_marker=drop_in_marker if f.path == CANARY_DROP_IN else None)
               for f in files])
    # The drop-in changes only how Caddy reloads and starts: a daemon-reload and a reload (now
    # through the filter), never a restart (requests in flight would be dropped).
    reloaded_service(name="Caddy reloads through the canary's filter", unit="caddy",
                     pending_marker=drop_in_marker, daemon_reload=True)
    service_running_its_files(
        name=f"Run {CANARY_TIMER} (a round every {host.data.canary.interval})",
        unit=CANARY_TIMER, depends_on=list(units),
        record=f"{install_root}/state/{CANARY_TIMER}.started")
