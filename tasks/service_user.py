"""The service user vLLM runs as (FlashInfer's JIT cache lives in its home) and our directories."""

from pyinfra import host
from pyinfra.api import deploy

from pyinfra_declared.files import directories
from pyinfra_declared.services import system_user


@deploy("Service user")
def apply() -> None:
    system_user(
        name=f"Create service user {host.data.service_user}",
        user=host.data.service_user,
        home=f"/home/{host.data.service_user}",
        shell="/usr/sbin/nologin",
    )
    root = host.data.install_root
    directories(name=f"Create {root} and its src, bin and state directories",
                paths=[root, f"{root}/src", f"{root}/bin", f"{root}/state"])
