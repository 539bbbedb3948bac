"""Custom pyinfra facts: each reads several related things in one remote command."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """Split output made of `@@name` header lines followed by that section's lines."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("@@"):
            current = line[2:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def _first(sections: dict[str, list[str]], name: str) -> str | None:
    return (sections.get(name) or [None])[0] or None


class HostProfile(FactBase):
    """Distro id (e.g. debian12) and, when nvidia-smi exists, each GPU's name and compute cap."""

    def command(self) -> str:
        return ("echo @@os; . /etc/os-release && echo \"$ID$VERSION_ID\" | tr -d .; "
                "echo @@gpus; if command -v nvidia-smi >/dev/null; then "
                "nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader || echo ERROR; "
                "else echo ABSENT; fi")

    def process(self, output: list[str]) -> dict:
        sections = _sections(output)
        gpu_lines = sections.get("gpus", [])
        gpus = None
        if gpu_lines and gpu_lines[0] not in ("ABSENT",):
            rows = [[p.strip() for p in line.split(",", 1)] for line in gpu_lines
                    if line and line != "ERROR"]
            gpus = [{"name": row[0], "compute_cap": row[-1]} for row in rows]
        return {"distro": (sections.get("os") or [""])[0], "gpus": gpus,
                "nvidia_smi_error": "ERROR" in gpu_lines}


class CudaStack(FactBase):
    """nvcc's release under a toolkit, and the CUDA version the venv's torch was built for.

    torch's version file is read rather than imported: an import costs seconds on every run.
    """

    def command(self, cuda_home: str, venv_dir: str) -> str:
        nvcc = shlex.quote(f"{cuda_home}/bin/nvcc")
        site = f"{shlex.quote(venv_dir)}/lib/python3*/site-packages"
        return (f"echo @@nvcc; if [ -x {nvcc} ]; then {nvcc} --version | "
                "sed -n 's/.*release \\([0-9.]*\\),.*/\\1/p'; fi; "
                f"echo @@torch; cat {site}/torch/version.py 2>/dev/null | "
                "sed -n \"s/^cuda[^=]*= *'\\([0-9.]*\\)'.*/\\1/p\"")

    def process(self, output: list[str]) -> dict:
        sections = _sections(output)
        return {"nvcc": _first(sections, "nvcc"), "torch_cuda": _first(sections, "torch")}


def digest_command(paths: list[str]) -> str:
    """Shell that prints one sha256 over the names and contents of `paths` (globs allowed,
    unquoted on purpose: venv paths contain python3.X); absent paths count as absent."""
    listing = " ".join(paths)
    return f"{{ ls -d {listing}; cat {listing}; }} 2>/dev/null | sha256sum | cut -c1-64"


class UnitState(FactBase):
    """A unit's load/active/enabled state, whether systemd wants a daemon-reload, the digest of
    what it depends on as it is on disk now, and the digest recorded when it was last started."""

    def command(self, unit: str, depends_on: list[str], record: str) -> str:
        return (f"systemctl show {shlex.quote(unit)} -p LoadState -p ActiveState "
                f"-p UnitFileState -p NeedDaemonReload; "
                f"echo OnDisk=$({digest_command(depends_on)}); "
                f"echo Recorded=$(cat {shlex.quote(record)} 2>/dev/null)")

    def process(self, output: list[str]) -> dict[str, str]:
        return dict(line.split("=", 1) for line in output if "=" in line)


class EditableInstall(FactBase):
    """Whether some distribution in the venv is installed editable from `source_dir`."""

    def command(self, venv_dir: str, source_dir: str) -> str:
        site = f"{shlex.quote(venv_dir)}/lib/python3*/site-packages"
        return (f"grep -ls {shlex.quote('file://' + source_dir.rstrip('/'))} "
                f"{site}/*.dist-info/direct_url.json || true")

    def process(self, output: list[str]) -> bool:
        return any(line.strip() for line in output)


class GitCheckout(FactBase):
    """The commit checked out in `dest` and the commit `ref` names there (None when absent)."""

    def command(self, dest: str, ref: str) -> str:
        quoted = shlex.quote(dest)
        return (f"echo @@head; git -C {quoted} rev-parse HEAD 2>/dev/null; "
                f"echo @@ref; git -C {quoted} rev-parse --verify -q "
                f"{shlex.quote(ref + '^{commit}')} 2>/dev/null; echo @@clean; "
                f"git -C {quoted} status --porcelain --untracked-files=no 2>/dev/null | head -1")

    def process(self, output: list[str]) -> dict:
        sections = _sections(output)
        return {"head": (sections.get("head") or [None])[0],
                "ref": (sections.get("ref") or [None])[0],
                "dirty": bool([line for line in sections.get("clean", []) if line.strip()])}
