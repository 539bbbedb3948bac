"""CUDA: NVIDIA's apt repository (or the mirror the data names) and the card's pinned toolkit,
side by side under /usr/local/cuda-X.Y. Nothing here touches the floating /usr/local/cuda."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_facts import host_profile
from donorkit.box.box_operations import toolkit_compiler
from pyinfra_declared.apt import apt_install, deb_from_url
from pyinfra_declared.files import config_file


@deploy("CUDA toolkit")
def apply() -> None:
    distro = host_profile()["distro"]
    repo_url = host.data.cuda_repo_url.format(distro=distro).rstrip("/")

    apt_install(name="Install what fetching the CUDA keyring needs",
                packages=["curl", "ca-certificates"], lock_wait=host.data.apt_lock_wait)
    deb_from_url(
        name="Install the CUDA repository keyring",
        url=f"{repo_url}/{host.data.cuda_keyring_deb}",
        provides=host.data.cuda_keyring_path,
        lock_wait=host.data.apt_lock_wait,
    )
    # Same file name as the keyring package's own list, so a mirror URL replaces NVIDIA's.
    config_file(
        name="Point apt at the CUDA repository",
        content=f"deb [signed-by={host.data.cuda_keyring_path}] {repo_url}/ /\n",
        dest=f"/etc/apt/sources.list.d/cuda-{distro}-x86_64.list",
    )
    apt_install(name=f"Install {host.data.cuda_package}", packages=[host.data.cuda_package],
                lock_wait=host.data.apt_lock_wait)
    toolkit_compiler(
        name=f"Check nvcc {host.data.cuda_version} in {host.data.cuda_home}",
        cuda_home=host.data.cuda_home,
        cuda_version=host.data.cuda_version,
        package=host.data.cuda_package,
        venv_dir=host.data.venv_dir,
    )
