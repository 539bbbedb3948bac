"""The CUDA toolkit at cuda_home, and what the model units' environment finds of it."""

from __future__ import annotations

import re

import pytest
from boxcheck import check, unit_env, with_env
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel


def test_nvcc_version(host: Host, data: DonorBox) -> None:
    nvcc = f"{data.cuda_home}/bin/nvcc"
    if not host.file(nvcc).exists:
        pytest.fail(f"{nvcc} does not exist", pytrace=False)
    out = check(host, f"{nvcc} --version", "nvcc --version").stdout
    found = re.search(r"release (\d+\.\d+)", out)
    assert found, f"no 'release X.Y' in nvcc --version:\n{out}"
    assert found[1] == data.cuda_version, f"{nvcc} is CUDA {found[1]}"


def test_cicc_runs(host: Host, data: DonorBox) -> None:
    """nvcc needs nvvm/bin/cicc ("cicc: command not found" killed the seed's warm-up)."""
    cicc = f"{data.cuda_home}/nvvm/bin/cicc"
    if not host.file(cicc).exists:
        pytest.fail(f"{cicc} does not exist", pytrace=False)
    # cicc has no --version: without an input it prints usage and exits 1. 126/127: cannot run.
    result = host.run(f"{cicc} --version")
    assert result.rc not in (126, 127), f"{cicc} does not run: {result.stderr}"
    assert "input file" in result.stdout + result.stderr, (
        f"{cicc} did not answer like cicc: {result.stdout}{result.stderr}")


def _find_in_dirs(host: Host, env: dict[str, str], var: str, name: str) -> str | None:
    for directory in filter(None, env.get(var, "").split(":")):
        if host.file(f"{directory}/{name}").exists:
            return f"{directory}/{name}"
    return None


@pytest.mark.parametrize("header", [
    "cuda_runtime.h",
    # FlashInfer 0.6.14's JIT (vLLM 0.26.0's FlashInfer attention) includes CUTLASS's
    # tensor_fill.h, which includes <curand_kernel.h>: without cuRAND's headers every prefill
    # kernel fails to compile and the engine dies at warmup (seen on the GPU harness with a
    # toolkit of nvcc, nvvm, crt, runtime and cccl only; NVIDIA's cuda-toolkit-X-Y has them).
    "curand_kernel.h",
])
def test_cuda_headers_on_cpath(host: Host, data: DonorBox, m: ServedModel, header: str) -> None:
    env, source = unit_env(host, data, m)
    print(f"environment from {source}")
    found = _find_in_dirs(host, env, "CPATH", header)
    assert found, f"{header} not under CPATH={env.get('CPATH')!r} ({source})"
    assert found.startswith(data.cuda_home + "/"), f"{found} is not from {data.cuda_home}"


def test_libcudart_on_library_path(host: Host, data: DonorBox, m: ServedModel) -> None:
    env, source = unit_env(host, data, m)
    print(f"environment from {source}")
    found = _find_in_dirs(host, env, "LIBRARY_PATH", "libcudart.so")
    assert found, f"libcudart.so not under LIBRARY_PATH={env.get('LIBRARY_PATH')!r} ({source})"


def test_ninja_on_unit_path(host: Host, data: DonorBox, m: ServedModel) -> None:
    """FlashInfer's JIT runs a bare `ninja`."""
    env, source = unit_env(host, data, m)
    print(f"environment from {source}")
    script = "command -v ninja && ninja --version"
    result = host.run(with_env({"PATH": env.get("PATH", "")}, script))
    assert result.rc == 0, f"ninja not found on PATH={env.get('PATH')!r} ({source})"


def test_nvcc_on_unit_path_is_cuda_home(host: Host, data: DonorBox, m: ServedModel) -> None:
    """`which nvcc` under the unit's PATH must be this toolkit's, not another side-by-side one."""
    env, source = unit_env(host, data, m)
    print(f"environment from {source}")
    assert env.get("CUDA_HOME") == data.cuda_home, f"CUDA_HOME={env.get('CUDA_HOME')!r}"
    result = host.run(with_env({"PATH": env.get("PATH", "")}, "command -v nvcc"))
    assert result.rc == 0, f"nvcc not found on PATH={env.get('PATH')!r} ({source})"
    assert result.stdout.strip() == f"{data.cuda_home}/bin/nvcc", (
        f"nvcc on the unit's PATH is {result.stdout.strip()}")
