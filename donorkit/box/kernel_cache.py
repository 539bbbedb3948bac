"""The engine's kernels, built once per stack: what a first start of vLLM compiles (FlashInfer's
JIT kernels, vLLM's torch.compile cache, Triton's and the CUDA driver's caches), kept on the
operator's machine and shipped to every later box of the same stack before its unit starts, so
that box's first start is a warm start (figures: docs/benchmarks.md). Entries are made and
trusted as the exllamav3 wheel's are (donorkit.box.wheel_cache): only a cache builder's kernels
are copied back and shipped; each archive is checked (check_archive) before it is stored and
before it is shipped (docs/reference.md "Least privilege on the box").
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pyinfra import host
from pyinfra.api import FactBase, FileUploadCommand, FunctionCommand

from donorkit.box import wheel_cache
from donorkit.box.box_facts import CudaStack
from donorkit.inventory.paths import operator_path
from pyinfra_declared.batched_facts import VenvDistributions, first, sections, shell_glob
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote
# A stack is everything the kernels depend on: the rendered unit's settings (flags and
# environment), the model's checkpoint and revision, the versions of KERNEL_DISTRIBUTIONS,
# nvcc's release, the card's arch, the distro and the CPU architecture. Cache layout on the
# operator's machine (the git-ignored `engine_kernel_cache`):
#     <cache>/<stack id>/kernels.tar, kernels.tar.sha256 (sha256sum output), stack.txt
ARCHIVE = "kernels.tar"
# Under the service user's home: what a first start leaves besides FlashInfer's kernels.
HOME_CACHES = (".cache/vllm", ".triton/cache", ".nv/ComputeCache")
FLASHINFER_BUILT = ".cache/flashinfer/*/*/cached_ops/*/*.so"
# One FlashInfer kernel as the home holds it (version, arch, NAME/NAME.so): what is archived.
FLASHINFER_KERNEL = re.compile(
    r"\.cache/flashinfer/[\w.+-]+/[\w.+-]+/cached_ops/([\w.+-]+)/\1\.so", re.ASCII)
# What an archive copied back may hold: the engine's caches of a first start, bounded (the
# lent H200's, qwen unit: tens of MB of kernels, a few hundred MB of caches).
ARCHIVE_MAX_BYTES = 16 << 30
ARCHIVE_MAX_MEMBERS = 200_000
# Relative to the venv: FlashInfer's package; its folder of precompiled kernels is data/aot.
# FlashInfer's kernels (`~/.cache/flashinfer/<version>/<arch>/cached_ops/NAME/NAME.so`) are
# shipped there, `data/aot/NAME/NAME.so` (flashinfer/jit/env.py and core.py, 0.6.14: looked at
# when no flashinfer-jit-cache is installed; a kernel found there is loaded as it is, no ninja),
# not into the home's JIT folder: ninja's deps log records each object's time, so copied objects
# are rebuilt whatever times the copy gives them ("stored deps info out of date"). The venv step
# removes that folder whenever it changes the venv (tasks/vllm_venv.py). The rest (HOME_CACHES,
# keyed by content hashes) goes into the service user's home, made and unpacked by that user
# (no link it planted leads root anywhere); the venv's part by root; neither keeps the
# archive's owners or modes.
FLASHINFER_PACKAGE = "lib/python3*/site-packages/flashinfer"
FLASHINFER_AOT = f"{FLASHINFER_PACKAGE}/data/aot"


class EngineKernels(FactBase):
    """What the box has: the key of the kernels it was given or left to build (`stamp`), the
    kernels and caches its engine built (paths relative to the service user's home), and the
    CPU architecture."""

    def command(self, stamp: str, home: str) -> str:
        caches = " ".join(map(q, HOME_CACHES))
        return (f"echo @@stamp; cat {q(stamp)} 2>/dev/null; echo; echo @@machine; uname -m; "
                f"echo @@built; cd {q(home)} 2>/dev/null && "
                f"for f in {FLASHINFER_BUILT} {caches}; do "
                "[ ! -e \"$f\" ] || echo \"$f\"; done; true")

    def process(self, output: list[str]) -> dict:
        found = sections(output)
        built = [line for line in found.get("built", []) if line]
        # Only FlashInfer's own layout (NAME/NAME.so); the rest are the home's cache folders.
        kernels = [p for p in built if FLASHINFER_KERNEL.fullmatch(p)
                   and ".." not in PurePosixPath(p).parts]
        return {"stamp": first(found, "stamp"), "machine": first(found, "machine"),
                "kernels": sorted(kernels),
                "caches": [p for p in built if p in HOME_CACHES]}


@dataclass(frozen=True)
class UnitKernels:
    """One unit's kernels on one box: what keys them and where they live."""

    unit: str
    unit_text: str  # the rendered unit, as installed
    checkpoint: str
    revision: str | None
    arch: str
    distro: str
    venv_dir: str
    cuda_home: str
    home: str  # the service user's
    service_user: str
    stamp: str  # on the box: the key of the kernels given to this unit (or left to it to build)
    box_dir: str  # on the box: where an archive is made before it is copied back
    cache_dir: str  # on the operator's machine
    # The inventory's cache builders (DonorBox.cache_builders): only they copy kernels back,
    # and only their kernels go to other boxes.
    builders: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelStack:
    key: str
    id: str
    entry: Path


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unit_settings(unit_text: str) -> str:
    """The unit less its comments: what the engine runs with (the header comment names the box,
    which must not make boxes of one stack look different)."""
    return "\n".join(line for line in unit_text.splitlines()
                     if not line.lstrip().startswith(("#", ";")))


# The venv's distributions whose versions decide what a first start compiles: the engine, the
# compilers it drives (torch's inductor, Triton, FlashInfer with its TVM FFI headers, CUTLASS's
# DSL) and the plugin and kernels it loads. Not the whole venv: boxes of one stack differ in
# what only a build needed (the first box builds exllamav3; the others get its wheel).
KERNEL_DISTRIBUTIONS = ("vllm", "torch", "triton", "flashinfer-python", "apache-tvm-ffi",
                        "nvidia-cutlass-dsl", "exllamav3", "vllm-exl3")


def stack_key(kernels: UnitKernels, distributions: dict[str, str], nvcc: str,
              machine: str) -> str:
    """One line naming everything the kernels depend on."""
    venv = ",".join(f"{name}=={distributions.get(name)}" for name in KERNEL_DISTRIBUTIONS)
    return (f"unit-{digest(unit_settings(kernels.unit_text))} "
            f"{kernels.checkpoint}@{kernels.revision or 'local'} "
            f"venv-{digest(venv)} vllm-{distributions.get('vllm')} "
            f"flashinfer-{distributions.get('flashinfer-python')} nvcc-{nvcc} sm-{kernels.arch} "
            f"{kernels.distro} {machine}")


KERNEL_FACTS = {
    "box": lambda op: need(EngineKernels, stamp=op.kernels.stamp, home=op.kernels.home),
    "venv": lambda op: need(VenvDistributions, venv_dir=op.kernels.venv_dir),
    "cuda": lambda op: need(CudaStack, cuda_home=op.kernels.cuda_home,
                            venv_dir=op.kernels.venv_dir),
}


def kernel_stack(kernels: UnitKernels, box: dict, venv: dict, cuda: dict) -> KernelStack:
    """The stack this unit's kernels are keyed by; refuses the host when the box cannot say."""
    missing = [what for what, value in (("vllm in the venv", venv.get("vllm")),
                                        ("nvcc", cuda["nvcc"]), ("uname -m", box["machine"]))
               if not value]
    if missing:
        fail(f"cannot key the kernels of {kernels.unit}: {', '.join(missing)} not found "
             f"(venv {kernels.venv_dir}, toolkit {kernels.cuda_home})")
    key = stack_key(kernels, venv, cuda["nvcc"], box["machine"])
    stack_id = hashlib.sha256(key.encode()).hexdigest()[:16]
    return KernelStack(key=key, id=stack_id,
                       entry=operator_path(kernels.cache_dir) / stack_id)


def member_problem(member: tarfile.TarInfo) -> str | None:
    """What is wrong with one member of a kernel archive (None: nothing)."""
    name, said = member.name, wheel_cache.shown(member.name)
    parts = name.rstrip("/").split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"{said}: not a plain relative path"
    if not (member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.isdir()):
        kind = ("a link" if member.issym() or member.islnk() else
                "a device or fifo" if member.isdev() else "not a regular file or folder")
        return f"{said}: {kind} (only files and folders)"
    if member.mode & 0o7000:
        return f"{said}: setuid/setgid/sticky bits (mode {member.mode:o})"
    if not (any(name == cache or name.startswith(f"{cache}/") for cache in HOME_CACHES)
            or (member.isfile() and FLASHINFER_KERNEL.fullmatch(name))):
        return f"{said}: outside the engine's caches ({', '.join(HOME_CACHES)}, FlashInfer's)"
    return None


def check_archive(path: Path, name: str | None = None) -> None:
    """Refuse (WheelCacheError, one line naming the file) a kernel archive holding anything but
    the engine's caches (member_problem), or too much. Headers only: nothing is unpacked."""
    problem = None
    try:
        with tarfile.open(path, "r:") as archive:
            count = size = 0
            for member in archive:
                count, size = count + 1, size + member.size
                problem = member_problem(member) or (
                    f"more than {ARCHIVE_MAX_MEMBERS} members" if count > ARCHIVE_MAX_MEMBERS
                    else f"more than {ARCHIVE_MAX_BYTES >> 30} GiB"
                    if size > ARCHIVE_MAX_BYTES else None)
                if problem:
                    break
    except (tarfile.TarError, OSError, UnicodeError) as exc:
        problem = f"not a readable tar archive ({wheel_cache.shown(str(exc))})"
    if problem:
        raise wheel_cache.WheelCacheError(f"{name or path.name}: {problem}: refused")


@dataclass(frozen=True)
class ArchiveCheck:
    """check_archive as the cache's `check` (a plain repr)."""

    def __call__(self, path: Path, name: str | None = None) -> None:
        check_archive(path, name)


def stamp_command(kernels: UnitKernels, key: str) -> str:
    stamp = q(kernels.stamp)
    return (f"mkdir -p {q(str(Path(kernels.stamp).parent))} && "
            f"printf '%s\\n' {q(key)} > {stamp}.tmp && mv {stamp}.tmp {stamp}")


@operation(**KERNEL_FACTS)
def ship_kernels(kernels: UnitKernels, box: dict, venv: dict, cuda: dict):
    """Before the unit starts: the kernels of its stack, when the operator's cache has them
    from a cache builder, unpacked into the venv's FlashInfer folder of precompiled kernels and
    the service user's home (the archive checked here, check_archive, and on the box against
    the cache's sha256 first). The stamp then records the stack; with no such kernels it records
    it too, and the engine builds its own on its first start (copied back after it when this
    box is a cache builder, keep_kernels)."""
    stack = kernel_stack(kernels, box, venv, cuda)
    if box["stamp"] == stack.key:
        host.noop(f"kernels of {kernels.unit} (stack {stack.id}) settled")
        return
    if not wheel_cache.has_entry(stack.entry, ARCHIVE):
        # The first box of this stack: its engine builds them on its first start.
        yield stamp_command(kernels, stack.key)
        return
    distrusted = wheel_cache.distrusted(stack.entry, kernels.builders)
    if distrusted:
        host.noop(f"the cached kernels of stack {stack.id} {distrusted}: not shipped, the "
                  f"engine of {kernels.unit} builds its own")
        yield stamp_command(kernels, stack.key)
        return
    try:
        path, sha = wheel_cache.cached_wheel(stack.entry, ARCHIVE)
        check_archive(path)
    except wheel_cache.WheelCacheError as exc:
        fail(str(exc))
    remote = f"{kernels.box_dir}/{stack.id}.tar"
    home, user = q(kernels.home), q(kernels.service_user)
    package = shell_glob(f"{kernels.venv_dir}/{FLASHINFER_PACKAGE}")
    yield f"mkdir -p {q(kernels.box_dir)}"
    yield FileUploadCommand(str(path), f"{remote}.part")
    yield (f"if ! echo {q(f'{sha}  {remote}.part')} | sha256sum -c --quiet; then "
           f"rm -f {q(remote)}.part; "
           f"echo {q(f'uploaded kernels of stack {stack.id} do not match the cache sha256 {sha}: not used')} >&2; "  # noqa: E501
           "exit 1; fi")
    # The home's part by the service user (root opens the archive, the user's tar reads it on
    # stdin): it writes only where that user may, follows no link of the user's as root, and
    # owns what it makes (no chown). Neither tar keeps the archive's owners or modes.
    yield (f"cd / && runuser -u {user} -- tar -C {home} --no-same-owner "
           f"--no-same-permissions -xf - --exclude=.cache/flashinfer < {q(remote)}.part")
    # FlashInfer's folder is in the venv, root's (the service user must not write there); its
    # kernels readable by the engine, as the rest of the venv (built under the unit's UMask 0077,
    # they come as 0600/0700).
    yield (f"for package in {package}; do [ -d \"$package\" ] || continue; "
           "mkdir -p \"$package/data/aot\" && "
           f"tar -C \"$package/data/aot\" --no-same-owner --no-same-permissions "
           f"-xf {q(remote)}.part --wildcards "
           "--transform 's,^\\.cache/flashinfer/[^/]*/[^/]*/cached_ops/,,' "
           "'.cache/flashinfer/*' && chmod -R u=rwX,go=rX \"$package/data/aot\" "
           "|| exit 1; done")
    yield f"rm -f {q(remote)}.part && {stamp_command(kernels, stack.key)}"


@operation(**KERNEL_FACTS)
def keep_kernels(kernels: UnitKernels, box: dict, venv: dict, cuda: dict):
    """After the unit is ready, on a cache builder: the kernels and caches its engine built,
    archived on the box (by the service user: only what it may read) and copied back to the
    operator's cache when the cache lacks a builder's entry of this stack (the first whole copy
    of a stack becomes the entry, if check_archive passes; a failure to cache stops this box
    only, with one line)."""
    stack = kernel_stack(kernels, box, venv, cuda)
    if host.name not in kernels.builders:
        host.noop(f"{host.name} is not a cache builder (cache_builder): what the engine of "
                  f"{kernels.unit} built stays on it")
        return
    if wheel_cache.trusted_entry(stack.entry, ARCHIVE, kernels.builders):
        host.noop(f"kernels of stack {stack.id} are cached")
        return
    if not box["kernels"]:
        host.noop(f"{kernels.unit} has built no FlashInfer kernels: nothing to keep")
        return
    remote_dir = f"{kernels.box_dir}/{stack.id}"
    remote = f"{remote_dir}/{ARCHIVE}"
    tmp_archive, tmp_sidecar = wheel_cache.download_names(ARCHIVE, host.name)
    entry = str(stack.entry)
    yield (f"mkdir -p {q(remote_dir)} && cd / && runuser -u {q(kernels.service_user)} -- "
           f"tar -C {q(kernels.home)} -cf - "
           f"{' '.join(map(q, [*box['kernels'], *box['caches']]))} > {q(remote)} && "
           f"cd {q(remote_dir)} && sha256sum {ARCHIVE} > {ARCHIVE}.sha256")
    yield FunctionCommand(wheel_cache.prepare_entry, (entry,), {})
    yield wheel_cache.CappedDownload(remote, f"{entry}/{tmp_archive}",
                                     ARCHIVE_MAX_BYTES)
    yield wheel_cache.CappedDownload(f"{remote}.sha256", f"{entry}/{tmp_sidecar}",
                                     wheel_cache.SIDECAR_MAX_BYTES)
    yield FunctionCommand(wheel_cache.commit_entry, (entry, ARCHIVE, stack.key,
                                                     kernels.builders, ArchiveCheck()), {})
    yield f"rm -rf {q(remote_dir)}"
