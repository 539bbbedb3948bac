"""Build tools: ninja (FlashInfer's JIT runs a bare `ninja`), a C++ toolchain, git, venv support."""

from pyinfra import host
from pyinfra.api import deploy

from pyinfra_declared.apt import apt_install


@deploy("Build tools")
def apply() -> None:
    apt_install(name="Install build tools", packages=host.data.build_packages,
                lock_wait=host.data.apt_lock_wait)
