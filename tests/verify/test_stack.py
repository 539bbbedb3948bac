"""The serving stack in the venv: pinned vLLM/torch, CUDA majors agreeing, exllamav3's extension
built for this card, and (where a driver is present) the card being the one the inventory says."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from boxcheck import as_user, check, missing, sass_archs, sm, unit_env, user_home, venv_json
from testinfra.host import Host

from donorkit.box.box_operations import driver_at_least
from donorkit.inventory.host_data import DonorBox, ServedModel

VERSIONS = ("import importlib.metadata as md, json\n"
            "def version(name):\n"
            "    try:\n        return md.version(name)\n"
            "    except md.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({d: version(d) for d in ('vllm', 'torch')}))")
TORCH_CUDA = "import json, torch; print(json.dumps(torch.version.cuda))"
EXT = "import json, torch, exllamav3_ext; print(json.dumps(exllamav3_ext.__file__))"


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # torch's local version (+cu130) names the wheel variant


def test_vllm_version(host: Host, data: DonorBox) -> None:
    found = venv_json(host, data.venv_dir, VERSIONS, "installed versions")
    if found["vllm"] is None:
        missing(host, f"vllm is not installed in {data.venv_dir}")
    # A card's CUDA variant (vllm_variant) shows as the local tag: 0.26.0+cu129.
    assert found["vllm"] == data.vllm_installed_version


def test_torch_version(host: Host, data: DonorBox) -> None:
    found = venv_json(host, data.venv_dir, VERSIONS, "installed versions")
    assert found["torch"], f"torch is not installed in {data.venv_dir}"
    assert _base(found["torch"]) == data.torch_version, found["torch"]


def test_torch_cuda_major_matches_nvcc(host: Host, data: DonorBox) -> None:
    """PyTorch's extension builder refuses an nvcc of another major (DESIGN.md)."""
    torch_cuda = venv_json(host, data.venv_dir, TORCH_CUDA, "torch.version.cuda")
    assert torch_cuda, "torch in the venv is a CPU-only build (torch.version.cuda is None)"
    out = check(host, f"{data.cuda_home}/bin/nvcc --version", "nvcc --version").stdout
    nvcc = re.search(r"release (\d+)\.", out)
    assert nvcc, f"no release in nvcc --version: {out}"
    assert torch_cuda.split(".")[0] == nvcc[1], (
        f"torch is built for CUDA {torch_cuda}, {data.cuda_home}/bin/nvcc is {nvcc[1]}.x")


def test_exllamav3_ext_built_for_card(host: Host, data: DonorBox) -> None:
    path = venv_json(host, data.venv_dir, EXT, "import exllamav3_ext")
    want = sm(data.card.arch)
    found, how = sass_archs(host, data.cuda_home, f"{data.venv_dir}/bin/python", path)
    print(f"{path}: SASS for {sorted(found)} (from {how})")
    assert want in found, f"{path} has no {want} code (has {sorted(found)}, from {how})"


def _gpus(host: Host) -> list[tuple[str, str, str]]:
    """(name, compute capability, driver version) of each GPU nvidia-smi lists."""
    if not host.exists("nvidia-smi"):
        pytest.skip("nvidia-smi is not on this box (no NVIDIA driver to ask)")
    out = check(host, "nvidia-smi --query-gpu=name,compute_cap,driver_version "
                      "--format=csv,noheader", "nvidia-smi").stdout
    gpus = [tuple(f.strip() for f in line.rsplit(",", 2)) for line in out.splitlines() if line]
    assert gpus, "nvidia-smi lists no GPU"
    return gpus


def test_gpu_is_the_inventory_card(host: Host, data: DonorBox) -> None:
    card = data.card
    for name, cap, _ in _gpus(host):
        assert (name, cap) == (card.gpu_name, card.arch), (
            f"GPU {name} (compute {cap}) is not the inventory's {card.name}: "
            f"{card.gpu_name} (compute {card.arch})")


def test_driver_is_new_enough_for_the_card_cuda(host: Host, data: DonorBox) -> None:
    """The preflight's refusal, checked again: torch's CUDA runtime needs this driver."""
    minimum = data.driver_minimum
    for name, _, driver in _gpus(host):
        assert driver_at_least(driver, minimum), (
            f"{name}: NVIDIA driver {driver} is older than {minimum}, the minimum for CUDA "
            f"{data.card.cuda} (card profile '{data.card.name}')")


TORCH_SEES_GPU = ("import json, torch; print(json.dumps([torch.cuda.is_available(), "
                  "torch.cuda.device_count() and torch.cuda.get_device_name(0)]))")


def test_torch_sees_the_gpu_as_service_user(host: Host, data: DonorBox, m: ServedModel) -> None:
    """`torch.cuda.is_available()` as the service user with the unit's environment: what
    "CUDA driver version is insufficient for CUDA runtime version" breaks, after installing."""
    if not host.file("/proc/driver/nvidia/version").exists:
        pytest.skip("no NVIDIA kernel driver here (/proc/driver/nvidia/version absent): no GPU")
    env, source = unit_env(host, data, m)
    user = data.service_user
    script = f"{data.venv_dir}/bin/python -c {shlex.quote(TORCH_SEES_GPU)}"
    result = host.run(as_user(user, user_home(host, user), env, script))
    assert result.rc == 0, f"torch as {user} ({source}):\n{result.stdout}\n{result.stderr}"
    available, device = json.loads(result.stdout.strip().splitlines()[-1])
    assert available, (f"torch.cuda.is_available() is False as {user} with the environment of "
                       f"{source}:\n{result.stderr}")
    print(f"torch as {user}: {device}")
