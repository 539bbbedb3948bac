"""Caddy's own apt repository (Caddy 2.11), where the host's `caddy_source` is `upstream`; with
`distro` (2.6.2 on Debian 12 and Ubuntu 24.04) nothing. Before the GPU-side and the edge Caddy."""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files

from pyinfra_declared.apt import apt_install
from pyinfra_declared.files import config_file


@deploy("Caddy repository")
def apply() -> None:
    if host.data.caddy_source == "upstream":
        apt_install(name="Install what fetching Caddy's key needs", packages=["curl", "gnupg"],
                    lock_wait=host.data.apt_lock_wait)
        keyring = "/usr/share/keyrings/caddy-stable-archive-keyring.gpg"
        files.download(name="Fetch Caddy's repository key", src=host.data.caddy_upstream_key_url,
                       dest=f"{keyring}.asc")
        config_file(
            name="Point apt at Caddy's repository",
            content=(f"deb [signed-by={keyring}.asc] {host.data.caddy_upstream_repo_url} "
                     "any-version main\n"),
            dest="/etc/apt/sources.list.d/caddy-stable.list",
        )
