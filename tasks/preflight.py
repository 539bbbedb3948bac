"""Preflight: the distro is supported, the GPU is the card the inventory names, and its NVIDIA
driver is new enough for the card profile's CUDA (its toolkit's, or the venv's CUDA variant's
when that needs a newer driver: inventory/defaults.yml cuda_driver_minimums): before anything is
installed."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_facts import host_profile
from donorkit.box.box_operations import host_matches_inventory


@deploy("Preflight")
def apply() -> None:
    host_matches_inventory(
        name="Check distro, GPU and driver against the inventory",
        profile=host_profile(),
        supported_distros=host.data.supported_distros,
        card=host.data.card,
        require_nvidia_smi=host.data.require_nvidia_smi,
        driver_minimum=host.data.driver_minimum,
        driver_cuda=host.data.driver_minimum_cuda,
    )
