"""The steps a Caddy's config takes on a GPU box and on an edge alike: the TLS directory, the
access log, each rendered file (a Caddyfile validated as the caddy user before it replaces the
live one), then one restart where the unit's settings changed and one reload where the config did.
Called from tasks/caddy.py and tasks/edge_caddy.py with what each renders."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from donorkit.render.templates import CADDY_DROP_IN, CADDYFILE, RenderedFile
from pyinfra_declared.files import ConfigFile, config_files, directories, owned_file
from pyinfra_declared.services import reloaded_service


def caddy_config(files: Iterable[RenderedFile], install_root: str, tls_dir: str,
                 access_log: str) -> None:
    reload_marker = f"{install_root}/state/caddy.reload-pending"
    # A changed unit drop-in (the admin socket's directory) needs a restart, not a reload.
    restart_marker = f"{install_root}/state/caddy.restart-pending"
    directories(name="Create the TLS directory", paths=[tls_dir], group="caddy", mode="750")
    # `caddy validate` opens the log file: as root it would create it root-owned, locking caddy
    # out.
    owned_file(name="Create the access log", path=access_log, user="caddy", group="caddy",
               mode="640")
    # One operation for all of them, the Caddyfile last: its validation reads the TLS files.
    ordered = sorted(files, key=lambda rendered: rendered.path == CADDYFILE)
    config_files(
        name=f"Install Caddy's files ({', '.join(Path(r.path).name for r in ordered)})",
        files=[ConfigFile(
            content=rendered.content,
            dest=rendered.path,
            mode=rendered.mode,
            user=rendered.user,
            group=rendered.group,
            validate=("runuser -u caddy -- caddy validate --adapter caddyfile --config {path} "
                      ">/dev/null" if rendered.path == CADDYFILE else None),
            pending_marker=restart_marker if rendered.path == CADDY_DROP_IN else reload_marker,
        ) for rendered in ordered],
    )
    # After the Caddyfile: a Caddy restarted on the old config would still serve its admin API on
    # TCP, where `caddy reload` (which reads the new config's admin address) cannot reach it.
    reloaded_service(name="Restart Caddy on its new unit settings", unit="caddy",
                     pending_marker=restart_marker, restart=True)
    reloaded_service(name="Run Caddy with the current config", unit="caddy",
                     pending_marker=reload_marker)
