"""Operations about donor boxes and edges: the card and toolkit checks, the exllamav3 wheel's steps,
the edge Caddy's module check. The generic ones (packages, files, users, venvs, units) are in
pyinfra_declared (apt, files, python_env, sources, services)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host
from pyinfra.api import (
    FileUploadCommand,
    FunctionCommand,
    QuoteString,
    StringCommand,
)

from donorkit.box import wheel_cache
from donorkit.box.box_facts import CaddyModules, CudaStack
from donorkit.box.wheel_cache import Exllamav3Stack
from donorkit.inventory.host_data import HostCard
from donorkit.inventory.paths import operator_path
from pyinfra_declared.batched_facts import shell_glob
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote


@operation()
def host_matches_inventory(profile: dict, supported_distros: list[str], card: HostCard,
                           require_nvidia_smi: bool, driver_minimum: str,
                           driver_cuda: str | None = None):
    """Refuse a box whose distro, GPU or NVIDIA driver (`profile`: the HostProfile fact, read
    when the deploy loads) is not what the inventory's card profile needs, before anything is
    installed on it. `driver_cuda`: the CUDA version that sets `driver_minimum` (the card's
    toolkit unless its venv's CUDA variant needs a newer driver)."""
    if profile["distro"] not in supported_distros:
        fail(f"distro {profile['distro'] or 'unknown'} is not supported "
             f"(supported: {', '.join(supported_distros)})")
    if card.engine == "cpu":
        host.noop(f"card profile '{card.name}' is vLLM's CPU engine: no GPU to check")
        return
    gpus = profile["gpus"]
    if gpus is None:
        if require_nvidia_smi:
            fail("nvidia-smi not found: install the NVIDIA driver first "
                 f"({driver_minimum} or newer for card profile '{card.name}')")
        host.noop("no nvidia-smi here (require_nvidia_smi is off): GPU not checked")
        return
    if profile["nvidia_smi_error"] or not gpus:
        fail("nvidia-smi is present but lists no GPU (driver not loaded?)")
    named = [g for g in gpus if g.get("name") == card.gpu_name]
    if not named:
        found = "; ".join(f"{g.get('name')} (compute {g.get('compute_cap')})" for g in gpus)
        fail(f"inventory says card '{card.name}' ({card.gpu_name}, compute "
             f"{card.arch}) but nvidia-smi reports {found}")
    gpu = next((g for g in named if g.get("compute_cap") == card.arch), None)
    if gpu is None:
        fail(f"nvidia-smi reports {card.gpu_name} with compute capability "
             f"{named[0].get('compute_cap')}, card profile '{card.name}' is built for "
             f"{card.arch}")
    driver = gpu.get("driver_version")
    if not driver_at_least(driver, driver_minimum):
        cuda = driver_cuda or card.cuda
        what = (f"CUDA {cuda}" if cuda == card.cuda else
                f"CUDA {cuda}, which its vLLM build ({card.vllm_variant}) runs")
        fail(f"NVIDIA driver {driver or 'unknown'} is older than {driver_minimum}, the minimum "
             f"for {what} (card profile '{card.name}'): upgrade the driver; "
             "nothing was installed")
    host.noop(f"{card.name} present, driver {driver} (>= {driver_minimum}), "
              f"distro {profile['distro']}")


def driver_at_least(found: str | None, minimum: str) -> bool:
    """NVIDIA driver versions compare as dotted numbers (580.65.06 >= 580.65.6 > 570.195)."""
    def numbers(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))
    try:
        return found is not None and numbers(found) >= numbers(minimum)
    except ValueError:
        return False


# Read with the venv the torch check reads, so one snapshot section serves both checks.
@operation(stack=lambda op: need(CudaStack, cuda_home=op.cuda_home, venv_dir=op.venv_dir))
def toolkit_compiler(cuda_home: str, cuda_version: str, package: str, venv_dir: str,
                     stack: dict):
    """Refuse to go on when the toolkit has no nvcc, or an nvcc of another release."""
    found = stack["nvcc"]
    if found is None:
        fail(f"{cuda_home}/bin/nvcc is missing after installing {package}: "
             "this toolkit cannot compile FlashInfer's JIT kernels or exllamav3")
    if found != cuda_version:
        fail(f"{cuda_home}/bin/nvcc reports release {found}, the card profile wants "
             f"{cuda_version}")
    host.noop(f"nvcc {found} at {cuda_home}")


@operation(stack=lambda op: need(CudaStack, cuda_home=op.cuda_home, venv_dir=op.venv_dir))
def torch_matches_nvcc(cuda_home: str, venv_dir: str, stack: dict):
    """PyTorch's extension builder refuses an nvcc whose major differs from torch's CUDA."""
    if not stack["torch_cuda"]:
        fail(f"torch in {venv_dir} reports no CUDA version (a CPU-only build?)")
    if not stack["nvcc"] or stack["nvcc"].split(".")[0] != stack["torch_cuda"].split(".")[0]:
        fail(f"torch in {venv_dir} is built for CUDA {stack['torch_cuda']} but "
             f"{cuda_home}/bin/nvcc is {stack['nvcc']}: majors must match "
             "(check the card profile's pip index)")
    host.noop(f"torch CUDA {stack['torch_cuda']} matches nvcc {stack['nvcc']}")


# exllamav3's wheel, in four steps that each read the same two facts (one snapshot section
# each): 1. upload the cached wheel of this box's stack, 2. or build it on the box, 3. install
# it, 4. copy a wheel built here back to the cache. Each step works out the stack's key from the
# facts (box_stack) and does nothing when its part is done.

@dataclass(frozen=True)
class Exllamav3Build:
    """What decides the wheel (besides what the box reports) and where it is kept."""

    version: str
    ref: str
    patches: tuple[str, ...]
    arch: str
    distro: str
    venv_dir: str
    cuda_home: str
    stamp: str  # on the box: the key of the stack installed
    box_dir: str  # on the box: <stack id>/<wheel> and its sha256 sidecar
    cache_dir: str  # on the operator's machine
    # The inventory's cache builders (DonorBox.cache_builders): only they copy a wheel back,
    # and only their wheels go to other boxes (donorkit/box/wheel_cache.py).
    builders: tuple[str, ...] = ()


@dataclass(frozen=True)
class BoxStack:
    key: str
    id: str
    wheel: str
    entry: Path  # the cache entry's directory
    remote_dir: str
    remote_wheel: str
    installed: bool  # the box's stamp names this stack
    on_box: bool  # the box holds this stack's wheel with its sidecar


WHEEL_FACTS = {
    "box": lambda op: need(Exllamav3Stack, venv_dir=op.build.venv_dir, stamp=op.build.stamp,
                           box_dir=op.build.box_dir),
    "cuda": lambda op: need(CudaStack, cuda_home=op.build.cuda_home,
                            venv_dir=op.build.venv_dir),
}


def box_stack(build: Exllamav3Build, box: dict, cuda: dict) -> BoxStack:
    """The key of the stack this box is on, and where its wheel lives; refuses the host when
    the box cannot say (no venv, no torch, no nvcc)."""
    facts = {**box, **cuda, "distro": build.distro}
    missing = [k for k in ("abi", "torch", "torch_cuda", "nvcc", "machine") if not facts[k]]
    if missing:
        fail(f"cannot key the exllamav3 wheel: {', '.join(missing)} not found "
             f"(venv {build.venv_dir}, toolkit {build.cuda_home})")
    key = wheel_cache.stack_key(build.version, build.ref,
                                wheel_cache.patches_digest(list(build.patches)), build.arch,
                                facts)
    stack_id = wheel_cache.stack_id(key)
    wheel = wheel_cache.wheel_name(build.version, facts["abi"], facts["machine"])
    remote_dir = f"{build.box_dir}/{stack_id}"
    return BoxStack(key=key, id=stack_id, wheel=wheel,
                    entry=operator_path(build.cache_dir) / "exllamav3" / stack_id,
                    remote_dir=remote_dir, remote_wheel=f"{remote_dir}/{wheel}",
                    installed=box["installed"] == key,
                    on_box=f"{stack_id}/{wheel}" in box.get("wheels", []))


@operation(**WHEEL_FACTS)
def upload_cached_wheel(build: Exllamav3Build, box: dict, cuda: dict):
    """Step 1: the cached wheel of this box's stack, uploaded and checked on the box against
    the cache's sha256 (a corrupt cached wheel refuses the host)."""
    stack = box_stack(build, box, cuda)
    if stack.installed or stack.on_box:
        host.noop(f"exllamav3 stack {stack.id}: {'installed' if stack.installed else 'on box'}")
        return
    if not wheel_cache.has_entry(stack.entry, stack.wheel):
        host.noop(f"no cached wheel for stack {stack.id}: the box builds it")
        return
    distrusted = wheel_cache.distrusted(stack.entry, build.builders)
    if distrusted:
        host.noop(f"the cached wheel of stack {stack.id} {distrusted}: not shipped, the box "
                  "builds its own")
        return
    try:
        path, digest = wheel_cache.cached_wheel(stack.entry, stack.wheel)
        wheel_cache.check_wheel(path, build.version)
    except wheel_cache.WheelCacheError as exc:
        fail(str(exc))
    q_wheel = q(stack.wheel)
    yield StringCommand("mkdir", "-p", QuoteString(stack.remote_dir))
    yield FileUploadCommand(str(path), f"{stack.remote_wheel}.part")
    yield (f"cd {q(stack.remote_dir)} && if echo {q(f'{digest}  {stack.wheel}.part')} | "
           f"sha256sum -c --quiet; then mv -f {q_wheel}.part {q_wheel} && "
           f"echo {q(f'{digest}  {stack.wheel}')} > {q_wheel}.sha256; else "
           f"rm -f {q_wheel}.part; echo {q(f'uploaded {stack.wheel} does not match the cache sha256 {digest}: not installed')} >&2; "  # noqa: E501
           "exit 1; fi")


@operation(**WHEEL_FACTS)
def build_wheel(build: Exllamav3Build, git_url: str, source_dir: str, script: str,
                gib_per_job: float, box: dict, cuda: dict):
    """Step 2: no wheel of this stack anywhere: build it on the box from the pinned ref, for
    this card's arch only (`script`, files/build_exllamav3.sh), leaving it with its sidecar."""
    stack = box_stack(build, box, cuda)
    if stack.installed or stack.on_box or wheel_cache.trusted_entry(stack.entry, stack.wheel,
                                                                     build.builders):
        host.noop(f"exllamav3 stack {stack.id}: nothing to build")
        return
    env = {"GIT_URL": git_url, "REF": build.ref, "SRC": source_dir, "VENV": build.venv_dir,
           "CUDA_HOME": build.cuda_home, "ARCH": build.arch, "GIB_PER_JOB": gib_per_job,
           "OUT_DIR": stack.remote_dir, "WHEEL": stack.wheel,
           "PATCHES": " ".join(f"{source_dir}-patches/{Path(p).name}" for p in build.patches)}
    assignments = " ".join(f"{k}={q(str(v))}" for k, v in env.items())
    yield f"env {assignments} sh {q(script)}"


def pip_install_wheel(venv_dir: str, version: str, wheel: str) -> str:
    """Shell, in the wheel's folder, as root: pip lays out the wheel `wheel` (exllamav3
    `version`) in the venv, isolated (-I), from that file only (no index, no dependencies,
    binary only: nothing is built or run); then refuses a .pth among the files it installed
    (their RECORD)."""
    record = f"{venv_dir}/lib/python3*/site-packages/exllamav3-{version}.dist-info/RECORD"
    return (f"{q(f'{venv_dir}/bin/python')} -I -m pip install -q --no-deps --no-index "
            f"--only-binary=:all: --force-reinstall ./{q(wheel)} && "
            f"if grep -q '[.]pth,' {shell_glob(record)}; then "
            f"echo {q(f'{wheel} installed a .pth file: refused')} >&2; exit 1; fi")


@operation(**WHEEL_FACTS)
def install_wheel(build: Exllamav3Build, service_user: str, box: dict, cuda: dict):
    """Step 3: the box's wheel of this stack, checked against its sidecar, installed, imported
    as the service user, and the stack's key written to the stamp (removed first, so a failed
    install is retried).

    pip runs as root (the venv is root's): `python -I` (no PYTHONPATH, no user site, not the
    working folder), installing this one file only (no index, no dependencies, binary only:
    nothing is built or run); what it imports is the root-owned venv's. The installed files
    (their RECORD) must carry no .pth, which the venv's Python would run at every start."""
    stack = box_stack(build, box, cuda)
    if stack.installed:
        host.noop(f"exllamav3 installed for stack {stack.id}")
        return
    q_wheel, q_stamp = q(stack.wheel), q(build.stamp)
    python = q(f"{build.venv_dir}/bin/python")
    # The import check runs with no compiler on PATH and no CUDA_HOME: exllamav3_ext is the
    # compiled module or nothing.
    check = "import torch, exllamav3_ext; print(exllamav3_ext.__file__)"
    yield (f"cd {q(stack.remote_dir)} && if ! sha256sum -c --quiet {q_wheel}.sha256; then "
           f"echo {q(f'{stack.remote_wheel} fails its sha256: not installed')} >&2; "
           f"rm -f {q_wheel} {q_wheel}.sha256; exit 1; fi && rm -f {q_stamp} && "
           f"{pip_install_wheel(build.venv_dir, build.version, stack.wheel)} && "
           f"cd / && runuser -u {q(service_user)} -- env -i PATH=/usr/bin:/bin "
           f"HOME=/tmp {python} -c {q(check)} && "
           f"mkdir -p {q(str(Path(build.stamp).parent))} && "
           f"printf '%s\\n' {q(stack.key)} > {q(build.stamp + '.tmp')} && "
           f"mv {q(build.stamp + '.tmp')} {q_stamp}")


@operation(**WHEEL_FACTS)
def copy_wheel_back(build: Exllamav3Build, box: dict, cuda: dict):
    """Step 4: a wheel built on this box, copied back to the operator's cache when this box is
    a cache builder and the cache lacks a builder's wheel of its stack; it enters the cache
    only if it matches its sidecar and holds exllamav3 only (wheel_cache.check_wheel). (A
    converged box's step only looks for the entry: hashing a wheel of tens of MB on every run,
    for every box, is waste.) In change detection before a build, the build's wheel counts as
    on the box. Each builder downloads under its own temporary names; the first whole copy of a
    stack becomes the entry and a failure to cache stops this box only, with one line
    (wheel_cache.commit_entry)."""
    stack = box_stack(build, box, cuda)
    if host.name not in build.builders:
        host.noop(f"{host.name} is not a cache builder (cache_builder): its exllamav3 wheel "
                  "stays on it")
        return
    if wheel_cache.trusted_entry(stack.entry, stack.wheel, build.builders):
        host.noop(f"exllamav3 stack {stack.id} is cached")
        return
    if stack.installed and not stack.on_box:
        host.noop(f"exllamav3 stack {stack.id} installed; the box no longer has its wheel")
        return
    entry, wheel = str(stack.entry), stack.wheel
    tmp_wheel, tmp_sidecar = wheel_cache.download_names(wheel, host.name)
    yield FunctionCommand(wheel_cache.prepare_entry, (entry,), {})
    yield wheel_cache.CappedDownload(stack.remote_wheel, f"{entry}/{tmp_wheel}",
                                     wheel_cache.WHEEL_MAX_BYTES)
    yield wheel_cache.CappedDownload(f"{stack.remote_wheel}.sha256", f"{entry}/{tmp_sidecar}",
                                     wheel_cache.SIDECAR_MAX_BYTES)
    yield FunctionCommand(wheel_cache.commit_entry, (entry, wheel, stack.key, build.builders,
                                                     wheel_cache.WheelCheck(build.version)), {})


@operation(modules=lambda op: need(CaddyModules))
def caddy_has_module(module: str, why: str, how: str, modules: list[str]):
    """Refuse the host when its Caddy lacks `module` (`modules`: what `caddy list-modules`
    lists; a config using the module would not load): `why` names what needs it, `how` says how
    to get such a Caddy. No command otherwise."""
    if module not in modules:
        fail(f"{why} needs the Caddy module {module}, which this box's caddy does not have "
             f"({len(modules)} modules listed): {how}")
    host.noop(f"caddy has {module}")
