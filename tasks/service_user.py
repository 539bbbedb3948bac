"""The service user vLLM runs as (FlashInfer's JIT cache lives in its home) and our directories."""

from pyinfra import host
from pyinfra.operations import files, server

server.user(
    name=f"Create service user {host.data.service_user}",
    user=host.data.service_user,
    home=f"/home/{host.data.service_user}",
    shell="/usr/sbin/nologin",
    system=True,
    create_home=True,
)
for directory in (host.data.install_root, f"{host.data.install_root}/src",
                  f"{host.data.install_root}/bin", f"{host.data.install_root}/state"):
    files.directory(name=f"Create {directory}", path=directory, user="root", group="root",
                    mode="755")
