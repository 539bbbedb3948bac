"""The serving stack in the venv: pinned vLLM/torch, CUDA majors agreeing, exllamav3's extension
built for this card, and (where a driver is present) the card being the one the inventory says."""

from __future__ import annotations

import re

import pytest
from boxcheck import check, missing, sass_archs, sm, venv_json
from testinfra.host import Host

VERSIONS = ("import importlib.metadata as md, json\n"
            "def version(name):\n"
            "    try:\n        return md.version(name)\n"
            "    except md.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({d: version(d) for d in ('vllm', 'torch')}))")
TORCH_CUDA = "import json, torch; print(json.dumps(torch.version.cuda))"
EXT = "import json, torch, exllamav3_ext; print(json.dumps(exllamav3_ext.__file__))"


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # torch's local version (+cu130) names the wheel variant


def test_vllm_version(host: Host, data: dict) -> None:
    found = venv_json(host, data["venv_dir"], VERSIONS, "installed versions")
    if found["vllm"] is None:
        missing(host, f"vllm is not installed in {data['venv_dir']}")
    assert found["vllm"] == data["vllm_version"]


def test_torch_version(host: Host, data: dict) -> None:
    found = venv_json(host, data["venv_dir"], VERSIONS, "installed versions")
    assert found["torch"], f"torch is not installed in {data['venv_dir']}"
    assert _base(found["torch"]) == data["torch_version"], found["torch"]


def test_torch_cuda_major_matches_nvcc(host: Host, data: dict) -> None:
    """PyTorch's extension builder refuses an nvcc of another major (DESIGN.md)."""
    torch_cuda = venv_json(host, data["venv_dir"], TORCH_CUDA, "torch.version.cuda")
    assert torch_cuda, "torch in the venv is a CPU-only build (torch.version.cuda is None)"
    out = check(host, f"{data['cuda_home']}/bin/nvcc --version", "nvcc --version").stdout
    nvcc = re.search(r"release (\d+)\.", out)
    assert nvcc, f"no release in nvcc --version: {out}"
    assert torch_cuda.split(".")[0] == nvcc[1], (
        f"torch is built for CUDA {torch_cuda}, {data['cuda_home']}/bin/nvcc is {nvcc[1]}.x")


def test_exllamav3_ext_built_for_card(host: Host, data: dict) -> None:
    path = venv_json(host, data["venv_dir"], EXT, "import exllamav3_ext")
    want = sm(data["card"]["arch"])
    found, how = sass_archs(host, data["cuda_home"], f"{data['venv_dir']}/bin/python", path)
    print(f"{path}: SASS for {sorted(found)} (from {how})")
    assert want in found, f"{path} has no {want} code (has {sorted(found)}, from {how})"


def test_gpu_is_the_inventory_card(host: Host, data: dict) -> None:
    if not host.exists("nvidia-smi"):
        pytest.skip("nvidia-smi is not on this box (no NVIDIA driver to ask)")
    out = check(host, "nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader",
                "nvidia-smi").stdout
    gpus = [tuple(f.strip() for f in line.split(",")) for line in out.splitlines() if line]
    card = data["card"]
    assert gpus, "nvidia-smi lists no GPU"
    for name, cap in gpus:
        assert (name, cap) == (card["gpu_name"], card["arch"]), (
            f"GPU {name} (compute {cap}) is not the inventory's {card['name']}: "
            f"{card['gpu_name']} (compute {card['arch']})")
