"""Rebuild a buildable exllamav3 v1.5.1 source repository from the release PyPI publishes.

The GPU box and this machine cannot reach GitHub. PyPI publishes exllamav3 1.5.1 only as
`exllamav3-1.5.1-py3-none-any.whl`, which carries the whole package, the extension's C++/CUDA
sources under exllamav3/exllamav3_ext/ included (its JIT loader compiles them at import). This
script downloads that wheel (sha256 pinned below), unpacks the package into DEST, writes a
setup.py that builds the extension the way upstream's setup.py does (same sources, same compiler
flags: see SETUP_PY), and commits the result as a git repository tagged v1.5.1, so the deploy's
clone -> build -> install path runs unchanged against it (exllamav3_git_url: file://DEST or a
copy of it).

Usage: python3 -m gpu.exllamav3_source [DEST]     (default: .gpu/exllamav3-src, git-ignored)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from donorkit.box.wheel_cache import file_sha256
from donorkit.inventory.paths import REPO_ROOT

VERSION = "1.5.1"
WHEEL = f"exllamav3-{VERSION}-py3-none-any.whl"
# sha256 of the file PyPI serves (checked on 2026-11-29); a different file is refused.
WHEEL_SHA256 = "4008285ed65009e882fb6f9f65264139c73e5566a57e8c6c73ffeebcf3c3af69"

# Mirrors upstream's setup.py (turboderp-org/exllamav3): one CUDAExtension `exllamav3_ext` of
# every .c/.cpp/.cu under exllamav3/exllamav3_ext, cxx `-Ofast`, nvcc `-lineinfo -O3
# --use_fast_math` with diagnostics 177 and 20012 suppressed, `-ccbin $CUDAHOSTCXX` when set,
# EXLLAMA_NOCOMPILE for a pure-Python install. The package list is found rather than spelled out,
# and package data (the extension sources, calibration data) ships as upstream's wheel does.
# Linux only (upstream's Windows flags are left out: no donor runs Windows).
SETUP_PY = '''\
"""exllamav3 1.5.1, rebuilt from the release PyPI publishes (gpu/exllamav3_source.py in the
uncloseai donor toolkit); the extension build mirrors upstream's setup.py."""

import os

from setuptools import find_packages, setup

extension_name = "exllamav3_ext"
precompile = "EXLLAMA_NOCOMPILE" not in os.environ
verbose = "EXLLAMA_VERBOSE" in os.environ

extra_cflags = ["-Ofast"]
extra_cuda_cflags = [
    "-lineinfo", "-O3", "--use_fast_math",
    "-Xcudafe", "--diag_suppress=177",
    "-Xcudafe", "--diag_suppress=20012",
]

if cuda_host_cxx := os.environ.get("CUDAHOSTCXX"):
    extra_cuda_cflags += ["-ccbin", cuda_host_cxx]

setup_kwargs = {}
if precompile:
    from torch.utils import cpp_extension

    sources_dir = os.path.join("exllamav3", extension_name)
    sources = sorted(
        os.path.join(root, name)
        for root, _, files in os.walk(sources_dir)
        for name in files
        if name.endswith((".c", ".cpp", ".cu"))
    )
    setup_kwargs = {
        "ext_modules": [
            cpp_extension.CUDAExtension(
                extension_name,
                sources,
                extra_compile_args={"cxx": extra_cflags, "nvcc": extra_cuda_cflags},
            )
        ],
        "cmdclass": {"build_ext": cpp_extension.BuildExtension},
    }

version_py = {}
with open("exllamav3/version.py", encoding="utf8") as fp:
    exec(fp.read(), version_py)

setup(
    name="exllamav3",
    version=version_py["__version__"],
    packages=find_packages(include=["exllamav3", "exllamav3.*"]),
    package_data={"": ["*"]},
    url="https://github.com/turboderp-org/exllamav3",
    license="MIT",
    author="turboderp",
    python_requires=">=3.10.11",
    verbose=verbose,
    **setup_kwargs,
)
'''


def download(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                    ":all:", "-d", str(into), f"exllamav3=={VERSION}"], check=True)
    wheel = into / WHEEL
    found = file_sha256(wheel)
    if found != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {found}, expected {WHEEL_SHA256}: refusing it")
    return wheel


def build_repo(wheel: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith("exllamav3/"):
                archive.extract(member, tmp)
            elif member.endswith("licenses/LICENSE"):
                (tmp / "LICENSE").write_bytes(archive.read(member))
    (tmp / "setup.py").write_text(SETUP_PY)
    (tmp / ".gitignore").write_text("build/\n*.egg-info/\n__pycache__/\n")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp), "-c", "user.name=uncloseai",
                        "-c", "user.email=uncloseai@localhost", *args], check=True,
                       stdout=subprocess.DEVNULL)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", f"exllamav3 {VERSION} from PyPI's {WHEEL} (sha256 {WHEEL_SHA256})")
    git("tag", f"v{VERSION}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def main() -> None:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / ".gpu" / "exllamav3-src"
    with tempfile.TemporaryDirectory() as scratch:
        build_repo(download(Path(scratch)), dest.resolve())
    print(f"{dest}: exllamav3 v{VERSION} source repository (tag v{VERSION})")


if __name__ == "__main__":
    main()
