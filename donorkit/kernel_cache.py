"""The engine's kernels, built once per stack: what a first start of vLLM compiles (FlashInfer's
JIT kernels, vLLM's torch.compile cache, Triton's and the CUDA driver's caches), kept on the
operator's machine and shipped to every later box of the same stack before its unit starts, so
that box's first start is a warm start.

Measured on the lent H200 with the rendered qwen unit (gpu/results/h200-engine-2026-12-01-evening,
docs/gpu.md): empty caches 558 s to ready (MAX_JOBS=4), a restart 99 s, a fresh install with
FlashInfer's kernels shipped 130 s, with every cache below shipped 86 s.

Where each part goes on the box:
- FlashInfer's kernels (`~/.cache/flashinfer/<version>/<arch>/cached_ops/NAME/NAME.so`) go into
  FlashInfer's own folder of precompiled kernels in the venv, `flashinfer/data/aot/NAME/NAME.so`
  (flashinfer/jit/env.py and core.py, 0.6.14: looked at when no flashinfer-jit-cache is
  installed; a kernel found there is loaded as it is, no ninja). Not into the home's JIT folder:
  ninja decides by file times, and its deps log records each object's time, so copied objects are
  rebuilt whatever times the copy gives them ("stored deps info out of date"). The venv step
  removes that folder whenever it changes the venv: its kernels belong to the set they were built
  with (tasks/vllm_venv.py).
- the rest (`~/.cache/vllm`, `~/.triton/cache`, `~/.nv/ComputeCache`: their entries are keyed by
  content hashes) into the service user's home, owned by it.

A stack here is everything the kernels depend on: the rendered unit's settings (flags and
environment), the model's checkpoint and revision, the versions of the venv's engine and
compilers (vLLM, torch, Triton, FlashInfer...: KERNEL_DISTRIBUTIONS), nvcc's release, the card's
arch, the distro and the CPU architecture. Cache layout on the operator's machine (the
git-ignored `engine_kernel_cache`):

    <cache>/<stack id>/kernels.tar, kernels.tar.sha256 (sha256sum output), stack.txt

Entries are made as the exllamav3 wheel's are (donorkit.wheel_cache: each box downloads under
its own temporary names, the sidecar is renamed in last under a lock, the first whole copy wins).
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pyinfra import host
from pyinfra.api import FactBase, FileUploadCommand, FunctionCommand

from donorkit import wheel_cache
from donorkit.box_facts import CudaStack
from donorkit.paths import repo_path
from pyinfra_declared.batched_facts import VenvDistributions, first, sections, shell_glob
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote
ARCHIVE = "kernels.tar"
# Under the service user's home: what a first start leaves besides FlashInfer's kernels.
HOME_CACHES = (".cache/vllm", ".triton/cache", ".nv/ComputeCache")
FLASHINFER_BUILT = ".cache/flashinfer/*/*/cached_ops/*/*.so"
# Relative to the venv: FlashInfer's package; its folder of precompiled kernels is data/aot.
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
        kernels = [p for p in built if p.endswith(".so")
                   and PurePosixPath(p).stem == PurePosixPath(p).parent.name]
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
                       entry=repo_path(kernels.cache_dir) / stack_id)


def stamp_command(kernels: UnitKernels, key: str) -> str:
    stamp = q(kernels.stamp)
    return (f"mkdir -p {q(str(Path(kernels.stamp).parent))} && "
            f"printf '%s\\n' {q(key)} > {stamp}.tmp && mv {stamp}.tmp {stamp}")


@operation(**KERNEL_FACTS)
def ship_kernels(kernels: UnitKernels, box: dict, venv: dict, cuda: dict):
    """Before the unit starts: the kernels of its stack, when the operator's cache has them,
    unpacked into the venv's FlashInfer folder of precompiled kernels and the service user's
    home (the archive checked on the box against the cache's sha256 first). The stamp then
    records the stack; with no cached kernels it records it too, and the engine builds its own
    on its first start (they are copied back after it, keep_kernels)."""
    stack = kernel_stack(kernels, box, venv, cuda)
    if box["stamp"] == stack.key:
        host.noop(f"kernels of {kernels.unit} (stack {stack.id}) settled")
        return
    try:
        cached = wheel_cache.cached_wheel(stack.entry, ARCHIVE)
    except wheel_cache.WheelCacheError as exc:
        fail(str(exc))
    if not cached:  # the first box of this stack: its engine builds them on its first start
        yield stamp_command(kernels, stack.key)
        return
    path, sha = cached
    remote = f"{kernels.box_dir}/{stack.id}.tar"
    home, user = q(kernels.home), q(kernels.service_user)
    package = shell_glob(f"{kernels.venv_dir}/{FLASHINFER_PACKAGE}")
    yield f"mkdir -p {q(kernels.box_dir)}"
    yield FileUploadCommand(str(path), f"{remote}.part")
    yield (f"if ! echo {q(f'{sha}  {remote}.part')} | sha256sum -c --quiet; then "
           f"rm -f {q(remote)}.part; "
           f"echo {q(f'uploaded kernels of stack {stack.id} do not match the cache sha256 {sha}: not used')} >&2; "  # noqa: E501
           "exit 1; fi")
    # --no-same-owner: the archive's owners are another box's ids.
    yield (f"tar -C {home} --no-same-owner -xf {q(remote)}.part "
           f"--exclude=.cache/flashinfer && "
           f"for d in {' '.join(map(q, HOME_CACHES))}; do [ ! -e {home}/\"$d\" ] || "
           f"{{ chown -R {user}: {home}/\"$d\" && chown {user}: {home}/\"${{d%/*}}\"; }} "
           "|| exit 1; done")
    yield (f"for package in {package}; do [ -d \"$package\" ] || continue; "
           "mkdir -p \"$package/data/aot\" && "
           f"tar -C \"$package/data/aot\" --no-same-owner -xf {q(remote)}.part --wildcards "
           "--transform 's,^\\.cache/flashinfer/[^/]*/[^/]*/cached_ops/,,' "
           f"'.cache/flashinfer/*' || exit 1; done")
    yield f"rm -f {q(remote)}.part && {stamp_command(kernels, stack.key)}"


@operation(**KERNEL_FACTS)
def keep_kernels(kernels: UnitKernels, box: dict, venv: dict, cuda: dict):
    """After the unit is ready: the kernels and caches its engine built, archived on the box and
    copied back to the operator's cache when the cache lacks this stack (the first whole copy of
    a stack becomes the entry; a failure to cache stops this box only, with one line)."""
    stack = kernel_stack(kernels, box, venv, cuda)
    if wheel_cache.has_entry(stack.entry, ARCHIVE):
        host.noop(f"kernels of stack {stack.id} are cached")
        return
    if not box["kernels"]:
        host.noop(f"{kernels.unit} has built no FlashInfer kernels: nothing to keep")
        return
    remote_dir = f"{kernels.box_dir}/{stack.id}"
    remote = f"{remote_dir}/{ARCHIVE}"
    tmp_archive, tmp_sidecar = wheel_cache.download_names(ARCHIVE, host.name)
    entry = str(stack.entry)
    yield (f"mkdir -p {q(remote_dir)} && tar -C {q(kernels.home)} -cf {q(remote)} "
           f"{' '.join(map(q, [*box['kernels'], *box['caches']]))} && "
           f"cd {q(remote_dir)} && sha256sum {ARCHIVE} > {ARCHIVE}.sha256")
    yield FunctionCommand(wheel_cache.prepare_entry, (entry,), {})
    yield wheel_cache.CappedDownload(remote, f"{entry}/{tmp_archive}",
                                     wheel_cache.KERNELS_DOWNLOAD_MAX_BYTES)
    yield wheel_cache.CappedDownload(f"{remote}.sha256", f"{entry}/{tmp_sidecar}",
                                     wheel_cache.SIDECAR_MAX_BYTES)
    yield FunctionCommand(wheel_cache.commit_entry, (entry, ARCHIVE, stack.key), {})
    yield f"rm -rf {q(remote_dir)}"
