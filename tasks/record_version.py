"""Last step on every box, donor or edge: the toolkit version that deployed it, in
`<install_root>/state/toolkit-version` (`make status` shows it)."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit import __version__
from pyinfra_declared.files import config_file


@deploy("Toolkit version")
def apply() -> None:
    config_file(name=f"Record the toolkit version ({__version__})", content=f"{__version__}\n",
                dest=f"{host.data.install_root}/state/toolkit-version", mode="644")
