"""The vLLM venv: pinned vllm and torch from the card profile's wheel variant, installed with uv
(pinned, put in the venv by its pip), root-owned, and a check that torch's CUDA major matches
the toolkit's nvcc (PyTorch refuses to build otherwise). A change of the set first removes the
engine kernels shipped into FlashInfer's folder for the old set (donorkit/box/kernel_cache.py).

pip and uv run as root: the venv is root's and holds only what root installed (the pinned set
from the card profile's index, the checked exllamav3 wheel, the plugin from root's folder), so
nothing they import is the service user's or another box's."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_operations import torch_matches_nvcc
from donorkit.box.kernel_cache import FLASHINFER_AOT
from donorkit.render.templates import VENV_BUSY_MARKER
from pyinfra_declared.python_env import python_venv, venv_packages


@deploy("vLLM venv")
def apply() -> None:
    venv = host.data.venv_dir

    python_venv(name=f"Create the venv {venv}", path=venv, python=host.data.venv_python)
    venv_packages(
        name=f"Install vllm {host.data.vllm_installed_version} and torch {host.data.torch_version}",
        venv_dir=venv,
        packages=host.data.venv_requirements,
        install=host.data.venv_install_specs,
        install_args=host.data.venv_index_args,
        uv=f"uv=={host.data.uv_version}",
        busy_marker=VENV_BUSY_MARKER,
        stale_on_change=[FLASHINFER_AOT],
    )
    if host.data.card.engine == "cuda":  # a cpu engine has no toolkit
        torch_matches_nvcc(
            name="Check torch's CUDA major against nvcc's",
            cuda_home=host.data.cuda_home,
            venv_dir=venv,
        )
