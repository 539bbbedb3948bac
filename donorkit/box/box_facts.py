"""Facts about a donor box: its distro and GPUs, nvcc's release and torch's CUDA version."""

from __future__ import annotations

import re
import shlex

from pyinfra import host
from pyinfra.api import FactBase

from pyinfra_declared.batched_facts import first, sections


class HostProfile(FactBase):
    """Distro id (e.g. debian12) and, when nvidia-smi exists, each GPU's name, compute
    capability and the NVIDIA driver's version."""

    def command(self) -> str:
        return ("echo @@os; . /etc/os-release && echo \"$ID$VERSION_ID\" | tr -d .; "
                "echo @@gpus; if command -v nvidia-smi >/dev/null; then "
                "nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader "
                "|| echo ERROR; else echo ABSENT; fi")

    def process(self, output: list[str]) -> dict:
        found = sections(output)
        gpu_lines = found.get("gpus", [])
        gpus = None
        if gpu_lines and gpu_lines[0] not in ("ABSENT",):
            # From the right: the last two fields are numbers, a name could hold a comma.
            rows = [[p.strip() for p in line.rsplit(",", 2)] for line in gpu_lines
                    if line and line != "ERROR"]
            gpus = [{"name": row[0], "compute_cap": row[1] if len(row) > 1 else None,
                     "driver_version": row[2] if len(row) > 2 else None} for row in rows]
        return {"distro": (found.get("os") or [""])[0], "gpus": gpus,
                "nvidia_smi_error": "ERROR" in gpu_lines}


class CudaStack(FactBase):
    """nvcc's release under a toolkit, and the CUDA version the venv's torch was built for.

    torch's version file is read rather than imported: an import costs seconds on every run.
    """

    def command(self, cuda_home: str, venv_dir: str) -> str:
        nvcc = shlex.quote(f"{cuda_home}/bin/nvcc")
        site = f"{shlex.quote(venv_dir)}/lib/python3*/site-packages"
        return (f"echo @@nvcc; if [ -x {nvcc} ]; then {nvcc} --version; fi; "  # parsed here
                "echo @@torch; sed -n \"s/^cuda[^=]*= *'\\([0-9.]*\\)'.*/\\1/p\" "
                f"{site}/torch/version.py 2>/dev/null || true")  # no venv yet: not a failure

    def process(self, output: list[str]) -> dict:
        found = sections(output)
        releases = [match[1] for line in found.get("nvcc", [])
                    if (match := re.search(r"release ([0-9.]+),", line))]
        return {"nvcc": (releases or [None])[0], "torch_cuda": first(found, "torch")}


_profiles: dict[str, dict] = {}


def host_profile() -> dict:
    """The current host's HostProfile, read once per run: the preflight and the CUDA repository
    URL both need it, and neither distro nor GPUs change while a deploy runs."""
    if host.name not in _profiles:
        _profiles[host.name] = host.get_fact(HostProfile)
    return _profiles[host.name]


class CaddyModules(FactBase):
    """The module ids the box's `caddy` binary has (`caddy list-modules`), e.g.
    `http.handlers.rate_limit`; empty when caddy is not installed."""

    def command(self) -> str:
        return "command -v caddy >/dev/null && caddy list-modules 2>/dev/null; true"

    def process(self, output: list[str]) -> list[str]:
        # One module id per line; Caddy adds blank lines and "Standard modules: N" counts.
        return [line.strip() for line in output
                if line.strip() and " " not in line.strip() and "." in line]

    def default(self) -> list[str]:
        return []
