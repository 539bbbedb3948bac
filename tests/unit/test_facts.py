"""The donor-box facts' commands run in a real shell here, and their output parses."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from donorkit.box.box_facts import CudaStack, HostProfile


def run(command: str) -> list[str]:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    return result.stdout.splitlines()


def test_cuda_stack_reads_nvcc_and_torch_version_without_importing(tmp_path: Path) -> None:
    cuda, venv = tmp_path / "cuda-13.3", tmp_path / "venv"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin/nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.3, V13.3.73'\n")
    nvcc.chmod(0o755)
    torch = venv / "lib/python3.12/site-packages/torch"
    torch.mkdir(parents=True)
    (torch / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\n")
    fact = CudaStack()
    assert fact.process(run(fact.command(str(cuda), str(venv)))) == {"nvcc": "13.3",
                                                                    "torch_cuda": "13.0"}
    nvcc.unlink()
    absent = fact.command(str(cuda), str(tmp_path / "none"))
    assert fact.process(run(absent)) == {"nvcc": None, "torch_cuda": None}
    # A box before its toolkit and venv exist: an answer, not a failed fact (pyinfra would stop).
    assert subprocess.run(["sh", "-c", absent], capture_output=True).returncode == 0


def test_host_profile_parses_os_release_and_nvidia_smi() -> None:
    fact = HostProfile()
    assert fact.process(["@@os", "ubuntu2404", "@@gpus",
                         "NVIDIA GeForce RTX 4090, 8.9, 580.95.05"]) == {
        "distro": "ubuntu2404", "gpus": [{"name": "NVIDIA GeForce RTX 4090", "compute_cap": "8.9",
                                          "driver_version": "580.95.05"}],
        "nvidia_smi_error": False}
    assert fact.process(["@@os", "debian12", "@@gpus", "ABSENT"])["gpus"] is None
    assert "--query-gpu=name,compute_cap,driver_version" in fact.command()
    # On this machine, whatever it runs: the same words Python reads from os-release.
    release = platform.freedesktop_os_release()
    here = fact.process(run(fact.command()))
    assert here["distro"] == release["ID"] + release.get("VERSION_ID", "").replace(".", "")
