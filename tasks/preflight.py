"""Preflight: the distro is supported and the GPU is the card the inventory names."""

from pyinfra import host

from donorkit.facts import host_profile
from donorkit.operations import host_matches_inventory

host_matches_inventory(
    name="Check distro and GPU against the inventory",
    profile=host_profile(),
    supported_distros=host.data.supported_distros,
    card=host.data.card,
    require_nvidia_smi=host.data.require_nvidia_smi,
)
