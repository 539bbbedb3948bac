"""Build what the real-engine GPU harness carries to the lent GPU machine (no network there), from
this repository alone, as 62 MiB chunks: one `run` call carries one of them.

    .venv/bin/python gpu/engine_carry.py        # or: make gpu-engine-carry
    -> .gpu-engine/carry/NN/part                # carry=[".gpu-engine/carry/NN"], one call each
       .gpu-engine/stage/                       # what the chunks hold, unpacked

What goes in:
- wheels/: vLLM 0.26.0 (PyPI) and its dependencies for CPython 3.12 x86_64, resolved by pip against
  PyPI's metadata with the image's torch 2.11.0+cu130 (and torchvision/torchaudio) standing in as
  metadata-only wheels, less EXCLUDED (each with its reason); requirements.json says which
  specifiers the set places on each distribution, so gpu/engine_install.py installs only what the
  GPU machine's image lacks or holds at a version outside them.
- cuda-13.3/: NVIDIA's CUDA 13.3 compiler wheels from PyPI (the testbed's list,
  tests/support/cuda_standin.py): the 4090 profile's toolkit, laid out as /usr/local/cuda-13.3.
- models/: gpu/tiny_checkpoints.py's stand-in checkpoints (made in a build venv with the CPU torch
  and transformers 5.17, the image's version).
- render/: `make render` of gpu/engine.yml's donors (the units the engines start from).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from donorkit.inventory.paths import REPO_ROOT as REPO
from tests.support.cuda_standin import HEADERS_ONLY, TOOLKITS

WORK = REPO / ".gpu-engine"
STAGE, CARRY, CACHE = WORK / "stage", WORK / "carry", WORK / "cache"
# A run call carries 64 MiB in all: a chunk plus the working tree (about 2.7 MiB in 2026-12).
CHUNK = 58 * 2**20
VLLM = "vllm==0.26.0"
IMAGE_TORCH = {"torch": "2.11.0+cu130", "torchvision": "0.26.0+cu130", "torchaudio": "2.11.0+cu130"}
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64",
             "manylinux_2_12_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64"]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
           "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# Not carried, with the reason. Everything else vLLM 0.26.0 pulls in is carried.
EXCLUDED = {
    "torch": "the image's 2.11.0+cu130 (vLLM 0.26.0 pins torch==2.11.0)",
    "torchvision": "the image's 0.26.0 (the pin)",
    "torchaudio": "the image's 2.11.0 (the pin)",
    "triton": "the image's 3.6.0, torch 2.11.0's own (3.9.0 is only the resolver's newest)",
    "nvidia-cutlass-dsl-libs-cu12": "the CUDA 12 half of cutlass-dsl (the image is CUDA 13)",
    "tokenspeed-mla": "MLA (DeepSeek-style) kernels: not imported for these architectures",
    "tokenspeed-triton": "tokenspeed-mla's Triton fork (as above)",
    "tilelang": "tilelang kernels (sparse MLA): not imported for these architectures",
    "z3-solver": "tilelang's solver (as above)",
    "pynvvideocodec": "video input decoding (these models take text)",
    "torchcodec": "video/audio input decoding (as above)",
    "opencv-python-headless": "the image has it (image inputs only)",
    "nvidia-cuda-nvcc": "a CUDA 13.5 compiler that kernel packages pull: the units name their own "
                        "toolkit (/usr/local/cuda-13.3, carried apart)",
    "nvidia-nvvm": "as nvidia-cuda-nvcc", "nvidia-cuda-crt": "as nvidia-cuda-nvcc",
    "nvidia-cuda-cccl": "as nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm": "as nvidia-cuda-nvcc",
    "nvidia-cuda-runtime": "torch's own CUDA 13.0 runtime is the image's",
    "nvidia-cuda-nvrtc": "torch's own CUDA 13.0 NVRTC is the image's",
}


def run(*cmd: str | os.PathLike, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def pip_download(dest: Path, *args: str) -> None:
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    run(sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
        "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *platform_args, "-d", dest, *args)


def torch_stubs(folder: Path) -> None:
    """Metadata-only wheels at the image's versions: the resolver takes them for the pins and
    looks no further into torch's own (CUDA) dependencies, which the image has."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in IMAGE_TORCH.items():
        info = f"{name}-{version}.dist-info"
        with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{info}/METADATA",
                           f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n")
            wheel.writestr(f"{info}/RECORD", "")


def resolve() -> list[dict]:
    """pip's resolution of vLLM for CPython 3.12 x86_64 (metadata only, nothing installed)."""
    stubs, report = CACHE / "stubs", CACHE / "report.json"
    torch_stubs(stubs)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    run(sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--dry-run",
        "--ignore-installed", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", *platform_args, "--target", CACHE / "never-written",
        "--find-links", stubs, "--report", report, VLLM)
    return json.loads(report.read_text())["install"]


def requirements(installs: list[dict]) -> dict[str, dict]:
    """For each resolved distribution: its wheel, version and the specifiers the set places on
    it (markers evaluated for CPython 3.12 on Linux x86_64, with the extras asked for)."""
    table = {canonicalize_name(i["metadata"]["name"]): {
        "version": i["metadata"]["version"], "url": i["download_info"]["url"],
        "wheel": i["download_info"]["url"].rsplit("/", 1)[-1].replace("%2B", "+"),
        "specifiers": [], "required_by": []} for i in installs}
    for item in installs:
        extras = [""] + list(item.get("requested_extras") or [])
        for text in item["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({**MARKERS, "extra": e})
                                      for e in extras):
                continue
            entry = table.get(canonicalize_name(req.name))
            if entry is not None:
                entry["specifiers"].append(str(req.specifier))
                entry["required_by"].append(item["metadata"]["name"])
    return table


def fetch_wheels(table: dict[str, dict]) -> None:
    wheels = STAGE / "wheels"
    wheels.mkdir(parents=True)
    pip_download(CACHE / "wheels", VLLM)
    for name, entry in table.items():
        if name in EXCLUDED or name == "vllm":
            continue
        target = CACHE / "wheels" / entry["wheel"]
        if not target.exists():
            run("curl", "-sSfL", "-o", target, entry["url"])
    for name, entry in table.items():
        if name not in EXCLUDED:
            os.link(CACHE / "wheels" / entry["wheel"], wheels / entry["wheel"])
    carried = {k: v for k, v in table.items() if k not in EXCLUDED}
    (STAGE / "requirements.json").write_text(json.dumps(
        {"carried": carried, "excluded": EXCLUDED}, indent=1, sort_keys=True))


def fetch_toolkit() -> None:
    folder = STAGE / "cuda-13.3"
    folder.mkdir(parents=True)
    for spec in TOOLKITS["13.3"][1]:
        pip_download(CACHE / "cuda", spec)
    for wheel in (CACHE / "cuda").glob("*.whl"):
        if not wheel.name.startswith(HEADERS_ONLY):
            os.link(wheel, folder / wheel.name)
            continue
        with zipfile.ZipFile(wheel) as whole, zipfile.ZipFile(folder / wheel.name, "w") as part:
            for info in whole.infolist():  # its headers only (77 MB of libraries stay here)
                if "/include/" in info.filename:
                    part.writestr(info, whole.read(info))


def make_checkpoints() -> None:
    venv = CACHE / "build-venv"
    if not (venv / "bin/python").exists():
        run(sys.executable, "-m", "venv", venv)
        run(venv / "bin/pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0",
            "transformers==5.17.0", "safetensors==0.8.0", "tokenizers==0.23.3", "numpy==2.3.5")
    run(venv / "bin/python", REPO / "gpu/tiny_checkpoints.py", STAGE / "models",
        env={**os.environ, "PYTHONPATH": str(REPO)})


def render_units() -> None:
    shutil.rmtree(WORK / "pki", ignore_errors=True)
    for donor in ("h200-qwen", "h200-hermes"):
        run(sys.executable, "-m", "donorkit.commands.render_cli", donor, STAGE / "render" / donor,
            cwd=REPO, env={**os.environ, "DONORS_FILE": str(REPO / "gpu/engine.yml")},
            stdout=subprocess.DEVNULL)


def split_into_chunks() -> list[Path]:
    shutil.rmtree(CARRY, ignore_errors=True)
    CARRY.mkdir(parents=True)
    archive = WORK / "stage.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(STAGE, arcname="stage")
    digest = hashlib.sha256()
    chunks = []
    with archive.open("rb") as whole:
        while block := whole.read(CHUNK):
            digest.update(block)
            folder = CARRY / f"{len(chunks) + 1:02d}"
            folder.mkdir()
            (folder / "part").write_bytes(block)
            chunks.append(folder)
    (CARRY / "01" / "manifest").write_text(f"{len(chunks)} {digest.hexdigest()}\n")
    archive.unlink()
    return chunks


def main() -> int:
    shutil.rmtree(STAGE, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    STAGE.mkdir(parents=True)
    table = requirements(resolve())
    fetch_wheels(table)
    fetch_toolkit()
    make_checkpoints()
    render_units()
    chunks = split_into_chunks()
    size = sum((c / "part").stat().st_size for c in chunks)
    print(f"{len(chunks)} chunks, {size / 2**20:.0f} MiB: `python3 -m gpu.engine_run receive` "
          f"with carry=['.gpu-engine/carry/NN'], one call each; the last one also `launch` and "
          f"`follow` (docs/gpu.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
