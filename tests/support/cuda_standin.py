"""STAND-IN for NVIDIA's CUDA apt repository (a flat repo, NVIDIA's layout), served to the hosts.

NVIDIA's servers are out of reach here, but NVIDIA publishes its compilers on PyPI: the 13.3 wheels
unpacked under /usr/local/cuda-13.3 make a real nvcc (it compiles and links for sm_89 on a CPU-only
box). For 12.8 PyPI has no nvcc binary, so cuda-toolkit-12-8 deliberately ships none: the deploy's
negative case. The repo and its keyring package are signed by a throwaway key kept in .testbed/gpg.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .common import WORK, log, run, sha256_of
from .network import GATEWAY

WHEELS = WORK / "wheels"
DEBS = WORK / "debs"
GNUPGHOME = WORK / "gpg"
REPO_PATH = "cuda"
REPO_URL = f"http://{GATEWAY}:8089/{REPO_PATH}"
KEYRING_PATH = "/usr/share/keyrings/cuda-archive-keyring.gpg"
KEYRING_DEB = "cuda-keyring_1.1-1_all.deb"
LIST_FILE = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"
BUILDER = "5"  # bump when the package layout below changes: cached debs are rebuilt

# toolkit version -> (package version, wheels on PyPI); each wheel unpacks under nvidia/<dir>/.
TOOLKITS: dict[str, tuple[str, list[str]]] = {
    # nvidia-cuda-crt carries include/crt/*.h (host_config.h): nvcc cannot compile without it.
    # nvidia-curand: <curand_kernel.h>, which FlashInfer's JIT includes (cuda-toolkit-13-3 has
    # libcurand-dev); only its headers are taken (HEADERS_ONLY), as the libraries are torch's.
    "13.3": ("13.3.73-1", ["nvidia-cuda-nvcc==13.3.73", "nvidia-nvvm==13.3.73",
                           "nvidia-cuda-crt==13.3.73", "nvidia-cuda-runtime==13.3.29",
                           "nvidia-cuda-cccl==13.3.5.0.6", "nvidia-curand==10.4.3.29"]),
    # The negative case: ptxas + libnvvm + runtime, and NO bin/nvcc (PyPI has none for 12.x).
    "12.8": ("12.8.93-1", ["nvidia-cuda-nvcc-cu12==12.8.93", "nvidia-cuda-runtime-cu12==12.8.90"]),
}
TINY_CU = r"""#include <cstdio>
__global__ void add_one(float *x) { x[threadIdx.x] += 1.0f; }
int main() {
  float *d = nullptr;
  if (cudaMalloc(&d, sizeof(float)) != cudaSuccess) { std::puts("built; no GPU here"); return 0; }
  add_one<<<1, 1>>>(d);
  return cudaDeviceSynchronize() == cudaSuccess ? 0 : 1;
}
"""


def build_repo(www: Path) -> Path:
    """Build (or reuse) the packages and write the signed flat repo under www/cuda/."""
    repo = www / REPO_PATH
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    debs = [build_keyring_deb()] + [build_toolkit_deb(v) for v in TOOLKITS]
    for deb in debs:
        os.link(deb, repo / deb.name)  # hard link: no copy of the 300 MB toolkit
    _write_indexes(repo)
    return repo


def _gpg(*args: str, **kw) -> subprocess.CompletedProcess:
    return run(["gpg", "--batch", "--homedir", GNUPGHOME, *args], **kw)


def signing_key() -> bytes:
    """The throwaway repo key (made once, kept in .testbed/gpg); returns the binary public key."""
    have = (GNUPGHOME / "pubring.kbx").exists() and _gpg("--list-secret-keys", quiet=True).stdout
    if not have:
        shutil.rmtree(GNUPGHOME, ignore_errors=True)
        GNUPGHOME.mkdir(mode=0o700, parents=True)
        _gpg("--passphrase", "", "--quick-gen-key",
             "uncloseai testbed CUDA stand-in <testbed@invalid>", "ed25519", "sign", "never")
    out = subprocess.run(["gpg", "--batch", "--homedir", str(GNUPGHOME), "--export"],
                         capture_output=True, check=True)
    return out.stdout


def build_keyring_deb() -> Path:
    """STAND-IN for cuda-keyring: installs our key where NVIDIA's goes, and a sources entry."""
    key = signing_key()
    listing = f"deb [signed-by={KEYRING_PATH}] {REPO_URL} /\n"
    control = ("Package: cuda-keyring\nVersion: 1.1-1\nArchitecture: all\nPriority: optional\n"
               "Section: misc\nMaintainer: uncloseai testbed <testbed@invalid>\n"
               "Description: STAND-IN for NVIDIA's cuda-keyring (testbed only)\n"
               " Installs the testbed repository's signing key and sources entry.\n")
    cached = DEBS / KEYRING_DEB
    if _fresh(cached, sha256_of(BUILDER, key, listing, control)):
        return cached
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _put(root / KEYRING_PATH.lstrip("/"), key, 0o644)
        _put(root / LIST_FILE.lstrip("/"), listing.encode(), 0o644)
        _put(root / "DEBIAN/control", control.encode(), 0o644)
        _put(root / "DEBIAN/conffiles", f"{LIST_FILE}\n".encode(), 0o644)
        _dpkg_deb(root, cached)
    _mark(cached, sha256_of(BUILDER, key, listing, control))
    return cached


def build_toolkit_deb(version: str) -> Path:
    """cuda-toolkit-X-Y from NVIDIA's wheels, laid out as /usr/local/cuda-X.Y; cached by inputs."""
    pkg_version, specs = TOOLKITS[version]
    name = f"cuda-toolkit-{version.replace('.', '-')}"
    wheels = [download_wheel(s) for s in specs]
    control = (f"Package: {name}\nVersion: {pkg_version}\nArchitecture: amd64\nPriority: optional\n"
               "Section: devel\nMaintainer: uncloseai testbed <testbed@invalid>\n"
               # nvcc drives the host C++ compiler; the real toolkit leaves that to the box.
               "Depends: g++\n"
               f"Description: STAND-IN for NVIDIA's {name} (testbed only)\n"
               f" NVIDIA's CUDA {version} wheels from PyPI under /usr/local/cuda-{version}.\n")
    inputs = [f"{w.name}:{w.stat().st_size}" for w in wheels]
    key = sha256_of(BUILDER, control, _postinst(version), _prerm(version), *inputs)
    cached = DEBS / f"{name}_{pkg_version}_amd64.deb"
    if _fresh(cached, key):
        return cached
    log(f"building {cached.name} from {len(wheels)} wheels")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prefix = root / f"usr/local/cuda-{version}"
        for w in wheels:
            unpack_wheel(w, prefix)
        finish_layout(prefix, version)
        _put(root / "DEBIAN/control", control.encode(), 0o644)
        _put(root / "DEBIAN/postinst", _postinst(version).encode(), 0o755)
        _put(root / "DEBIAN/prerm", _prerm(version).encode(), 0o755)
        _dpkg_deb(root, cached)
    check_toolkit_deb(cached, version)
    _mark(cached, key)
    return cached


def _postinst(version: str) -> str:
    """As NVIDIA's *-config-common packages: /usr/local/cuda and /usr/local/cuda-MAJOR are
    alternatives to the newest toolkit (so a unit that wrongly uses them shows up in tests)."""
    major, prio = version.split(".")[0], version.replace(".", "")
    return ("#!/bin/sh\nset -e\n"
            f"update-alternatives --install /usr/local/cuda cuda /usr/local/cuda-{version} {prio}\n"
            f"update-alternatives --install /usr/local/cuda-{major} cuda-{major} "
            f"/usr/local/cuda-{version} {prio}\n")


def _prerm(version: str) -> str:
    major = version.split(".")[0]
    return ("#!/bin/sh\nset -e\n"
            f"update-alternatives --remove cuda /usr/local/cuda-{version}\n"
            f"update-alternatives --remove cuda-{major} /usr/local/cuda-{version}\n")


def download_wheel(spec: str) -> Path:
    """One wheel, downloaded once into .testbed/wheels (the 13.3 set is ~160 MB)."""
    name, version = spec.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(WHEELS.glob(pattern))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", WHEELS, spec])
        found = sorted(WHEELS.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download {spec} left no {pattern} in {WHEELS}")
    return found[0]


# Wheels of which only include/ goes into the toolkit tree.
HEADERS_ONLY = ("nvidia_curand-",)


def unpack_wheel(wheel: Path, prefix: Path) -> None:
    """nvidia/<any>/X -> prefix/X, with lib/ -> lib64/ (the toolkit's layout); keep exec bits."""
    headers_only = wheel.name.startswith(HEADERS_ONLY)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = Path(info.filename).parts
            if len(parts) < 3 or parts[0] != "nvidia" or info.is_dir():
                continue
            rel = Path(*parts[2:])
            if headers_only and rel.parts[0] != "include":
                continue
            if rel.name == "__init__.py" or "__pycache__" in rel.parts or rel.parts[0] == "cccl":
                continue  # Python package glue and CCCL's cmake files: not part of a toolkit tree
            if rel.parts[0] == "lib":
                rel = Path("lib64", *rel.parts[1:])
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            if mode & 0o111:  # the wheels ship rwxr--r--; NVIDIA's toolkit lets any user run nvcc
                mode |= 0o111
            _put(prefix / rel, zf.read(info), mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


def finish_layout(prefix: Path, version: str) -> None:
    major = version.split(".")[0]
    lib64 = prefix / "lib64"
    # Linking -lcudart needs the unversioned name, as in NVIDIA's packages.
    if (lib64 / f"libcudart.so.{major}").exists():
        (lib64 / "libcudart.so").symlink_to(f"libcudart.so.{major}")
    # The 13.x wheels' nvcc.profile says -L$(TOP)/lib; the toolkit's real directory is lib64.
    if (prefix / "bin/nvcc.profile").exists():
        (prefix / "lib").symlink_to("lib64")


def check_toolkit_deb(deb: Path, version: str) -> None:
    """Extract the package and prove it: 13.3 compiles+links for sm_89; 12.8 has no nvcc."""
    with tempfile.TemporaryDirectory() as tmp:
        run(["dpkg-deb", "-x", deb, tmp])
        nvcc = Path(tmp) / f"usr/local/cuda-{version}/bin/nvcc"
        if version == "12.8":
            if nvcc.exists():
                raise RuntimeError(f"{deb.name} must not ship bin/nvcc")
            return
        src = Path(tmp) / "tiny.cu"
        src.write_text(TINY_CU)
        run([nvcc, "-arch=sm_89", "-o", Path(tmp) / "tiny", src])
        log(f"{deb.name}: nvcc compiled and linked a kernel for sm_89")


def _write_indexes(repo: Path) -> None:
    """Packages, Release, InRelease and Release.gpg, as a flat repo (`deb URL /`) has them."""
    packages = run(["apt-ftparchive", "packages", "."], cwd=repo).stdout
    (repo / "Packages").write_text(packages)
    (repo / "Packages.gz").write_bytes(gzip.compress(packages.encode(), mtime=0))
    release = run(["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=uncloseai-testbed",
                   "-o", "APT::FTPArchive::Release::Label=CUDA stand-in",
                   "-o", "APT::FTPArchive::Release::Architectures=amd64 all",
                   "release", "."], cwd=repo).stdout
    (repo / "Release").write_text(release)
    _gpg("--yes", "--clearsign", "-o", repo / "InRelease", repo / "Release")
    _gpg("--yes", "-abs", "-o", repo / "Release.gpg", repo / "Release")


def _dpkg_deb(root: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # zstd at a low level: a 300 MB tree packs in seconds on 2 cores (xz takes minutes).
    run(["dpkg-deb", "--root-owner-group", "-Zzstd", "-z3", "--build", root, out])


def _put(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _fresh(deb: Path, key: str) -> bool:
    stamp = deb.with_suffix(".inputs")
    return deb.exists() and stamp.exists() and stamp.read_text() == key


def _mark(deb: Path, key: str) -> None:
    deb.with_suffix(".inputs").write_text(key)
