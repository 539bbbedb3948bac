"""Build tools: ninja (FlashInfer's JIT runs a bare `ninja`), a C++ toolchain, git, venv support."""

from pyinfra import host

from pyinfra_declared.apt import apt_install

apt_install(name="Install build tools", packages=host.data.build_packages,
            lock_wait=host.data.apt_lock_wait)
