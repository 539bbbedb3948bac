"""Custom pyinfra operations. Each yields no command when the host already matches, so a
converged host reports zero changes, and each leaves nothing half-done when interrupted."""

from __future__ import annotations

import functools
import hashlib
import io
import shlex
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from pyinfra import host
from pyinfra.api import (
    FileDownloadCommand,
    FileUploadCommand,
    FunctionCommand,
    StringCommand,
    operation,
)
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.files import File

from donorkit import wheel_cache
from donorkit.facts import (
    CudaStack,
    DebStatus,
    EditableInstall,
    GitCheckout,
    PathStates,
    UnitState,
    UserAccount,
    VenvDistributions,
    digest_command,
    normalized_name,
)
from donorkit.prefetch import Request, read, read_request, reads
from donorkit.wheel_cache import Exllamav3Stack

# `uncloseai_apt_get WAIT ARGS...`: apt-get once apt's and dpkg's locks are free (waiting up to
# WAIT s, said on stderr), after finishing an interrupted dpkg. Prepended to each apt command.
APT_FUNCTIONS = (Path(__file__).resolve().parent.parent / "files/apt_get.sh").read_text()


def _apt_get(lock_wait: int, *commands: str) -> str:
    """Shell running `apt-get <command>` for each, in order, through uncloseai_apt_get (the
    caller puts APT_FUNCTIONS first)."""
    return " && ".join(f"uncloseai_apt_get {int(lock_wait)} {c}" for c in commands)


class Refusal(Exception):
    """Raised inside an operation: this host must not go on."""


def _fail(message: str) -> None:
    raise Refusal(f"{host.name}: {message}")


def refusals_fail_the_host(func: Callable) -> Callable:
    """Turn a Refusal into a command that fails with the message on the host's stderr. An
    exception in an operation would abort the whole run; a failing command stops this host
    only, and pyinfra carries on with the others (one broken box never stops the fleet)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator:
        try:
            yield from func(*args, **kwargs)
        except Refusal as refusal:
            yield f"echo {shlex.quote(f'uncloseai: {refusal}')} >&2; exit 1"

    return wrapper


@reads(lambda packages, **_: [(DebStatus, {"packages": packages})])
@operation()
def apt_install(packages: list[str], lock_wait: int = 600):
    """Install the missing packages; refresh the lists only when something is missing. Each
    apt-get waits (up to `lock_wait` s) for apt's and dpkg's locks, and an interrupted dpkg is
    finished first (files/apt_get.sh)."""
    installed = read(DebStatus, packages=packages)
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"installed: {' '.join(packages)}")
        return
    packages_args = " ".join(map(shlex.quote, missing))
    yield APT_FUNCTIONS + _apt_get(lock_wait, "update -q", f"install -y -q {packages_args}")


@reads(lambda dest, **_: [(PathStates, {"paths": [dest], "digest": [dest]})])
@operation()
def config_file(content: str, dest: str, mode: str = "644", user: str = "root",
                group: str = "root", validate: str | None = None,
                pending_marker: str | None = None):
    """Install `content` at `dest` via a staged copy: validated (`{path}` in `validate` names the
    staged file) before it replaces the live one; `pending_marker` is touched before the swap so a
    reload that was due survives a run that dies right after it."""
    want = hashlib.sha256(content.encode()).hexdigest()
    current = read(PathStates, paths=[dest], digest=[dest]).get(dest, {})
    if (current.get("type", "").startswith("regular") and current.get("sha256") == want
            and current["mode"] == mode.lstrip("0")
            and (current["user"], current["group"]) == (user, group)):
        host.noop(f"{dest} is current")
        return
    # Staged in a fresh private directory beside `dest` (0700, the login user's, never a
    # world-readable temporary file: pyinfra's upload for a sudo login goes through
    # remote_temp_filename, placed in it too). The staged file keeps dest's name, so a validator
    # that reads the suffix (systemd-analyze verify: .service) sees it; the final mv is a rename
    # within one file system. Leftovers of an interrupted run are removed first.
    parent, name = str(Path(dest).parent), Path(dest).name
    stage_dir = f"{parent}/.uncloseai-stage-{want[:12]}"
    staged = f"{stage_dir}/{name}"
    q_dir, q_staged, q_dest = shlex.quote(stage_dir), shlex.quote(staged), shlex.quote(dest)
    login = shlex.quote(host.data.get("ssh_user") or "root")
    yield (f"mkdir -p {shlex.quote(parent)} && rm -rf {shlex.quote(parent)}/.uncloseai-stage-* "
           f"&& mkdir -m 700 {q_dir} && chown {login} {q_dir}")
    yield FileUploadCommand(io.BytesIO(content.encode()), staged,
                            remote_temp_filename=f"{stage_dir}/.upload")
    # Once the file has its owner and mode, the directory opens to traversal (0711): a validator
    # running as another user (caddy) can read the file if the file's own mode lets it.
    steps = [f"chown {shlex.quote(f'{user}:{group}')} {q_staged}",
             f"chmod {shlex.quote(mode)} {q_staged}", f"chmod 711 {q_dir}"]
    if validate:
        steps.append(f"{{ {validate.format(path=q_staged)}; }}")
    if pending_marker:
        marker = shlex.quote(pending_marker)
        steps.append(f"mkdir -p {shlex.quote(str(Path(pending_marker).parent))} && "
                     f"touch {marker}")
    steps.append(f"mv -f {q_staged} {q_dest} && rmdir {q_dir}")
    yield " && ".join(steps) + f" || {{ rc=$?; rm -rf {q_dir}; exit $rc; }}"


@reads(lambda paths, **_: [(PathStates, {"paths": paths})])
@operation()
@refusals_fail_the_host
def directories(paths: list[str], user: str = "root", group: str = "root", mode: str = "755"):
    """Directories with this owner and mode, all checked in one command."""
    states = read(PathStates, paths=paths)
    wrong = []
    for path in paths:
        state = states.get(path)
        if state and state["type"] != "directory":
            _fail(f"{path} exists and is a {state['type']}, not a directory")
        if not state or (state["user"], state["group"], state["mode"]) != (
                user, group, mode.lstrip("0")):
            wrong.append(shlex.quote(path))
    if not wrong:
        host.noop(f"{len(paths)} directories in place")
        return
    listing = " ".join(wrong)
    yield f"mkdir -p {listing} && chown {user}:{group} {listing} && chmod {mode} {listing}"


@reads(lambda path, user, group, mode, **_: [(PathStates, {"paths": [path]})])
@operation()
@refusals_fail_the_host
def owned_file(path: str, user: str, group: str, mode: str):
    """A file (created empty, its content is not ours: a log) with this owner and mode."""
    state = read(PathStates, paths=[path]).get(path)
    if state and not state["type"].startswith("regular"):
        _fail(f"{path} exists and is a {state['type']}, not a file")
    if state and (state["user"], state["group"], state["mode"]) == (user, group, mode.lstrip("0")):
        host.noop(f"{path} in place")
        return
    q = shlex.quote(path)
    yield (f"mkdir -p {shlex.quote(str(Path(path).parent))} && touch {q} && "
           f"chown {user}:{group} {q} && chmod {mode} {q}")


@reads(lambda path, **_: [(PathStates, {"paths": [f"{path}/bin/activate"]})])
@operation()
def python_venv(path: str, python: str):
    """A venv made by `python -m venv` (again, in place, when bin/activate is missing: venv
    writes it last, so a venv whose creation was interrupted is completed)."""
    if read(PathStates, paths=[f"{path}/bin/activate"]):
        host.noop(f"venv {path} present")
        return
    yield f"{shlex.quote(python)} -m venv {shlex.quote(path)}"


@reads(lambda user, **_: [(UserAccount, {"user": user})])
@operation()
def system_user(user: str, home: str, shell: str):
    """A system user with this home (created, owned by the user) and login shell."""
    account = read(UserAccount, user=user)
    q_user, q_home, q_shell = shlex.quote(user), shlex.quote(home), shlex.quote(shell)
    if account is None:
        # A group of that name left from an earlier user is reused, as useradd would refuse it.
        yield (f"useradd --system --create-home --home-dir {q_home} --shell {q_shell} "
               f"$(getent group {q_user} >/dev/null && echo --gid {q_user}) {q_user}")
        return
    changes = []
    if account["home"] != home:
        changes.append(f"--home {q_home}")
    if account["shell"] != shell:
        changes.append(f"--shell {q_shell}")
    if changes:
        yield f"usermod {' '.join(changes)} {q_user}"
    if account["home"] != home or account["home_owner"] != user:
        yield f"mkdir -p {q_home} && chown {q_user}: {q_home}"
    if not changes and account["home_owner"] == user:
        host.noop(f"user {user} is in place")


@reads(lambda venv_dir, **_: [(VenvDistributions, {"venv_dir": venv_dir})])
@operation()
@refusals_fail_the_host
def venv_packages(venv_dir: str, packages: list[str], extra_install_args: str = "",
                  install: list[str] | None = None):
    """Each requirement (`name==version` and the like) satisfied in the venv; pip installs them
    all together when any is not, so its resolver sees the whole set: `install` when given
    (the same requirements, some as direct references: `vllm @ <wheel URL>`), else `packages`."""
    installed = read(VenvDistributions, venv_dir=venv_dir)
    unmet = []
    for spec in packages:
        try:
            requirement = Requirement(spec)
        except InvalidRequirement as exc:
            _fail(f"venv package {spec!r} is not a pip requirement: {exc}")
        version = installed.get(normalized_name(requirement.name))
        # `==2.11.0` accepts 2.11.0+cu130, as pip does: the index's local tag is not a mismatch.
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement.name} ({version or 'absent'})")
    if not unmet:
        host.noop(f"{len(packages)} requirements met in {venv_dir}")
        return
    yield " ".join([f"{venv_dir}/bin/pip install -q", *filter(None, [extra_install_args]),
                    *map(shlex.quote, install or packages)])


@reads(lambda cuda_home, venv_dir, **_: [(CudaStack, {
    "cuda_home": cuda_home,
    "venv_dir": venv_dir,
})])
@operation()
@refusals_fail_the_host
def toolkit_compiler(cuda_home: str, cuda_version: str, package: str, venv_dir: str):
    """Refuse to go on when the toolkit has no nvcc, or an nvcc of another release. (Read with
    the venv the torch check reads, so on a converged box one snapshot section serves both.)"""
    found = read(CudaStack, cuda_home=cuda_home, venv_dir=venv_dir)["nvcc"]
    if found is None:
        _fail(f"{cuda_home}/bin/nvcc is missing after installing {package}: "
              "this toolkit cannot compile FlashInfer's JIT kernels or exllamav3")
    if found != cuda_version:
        _fail(f"{cuda_home}/bin/nvcc reports release {found}, the card profile wants "
              f"{cuda_version}")
    host.noop(f"nvcc {found} at {cuda_home}")
    return
    yield  # an operation is a generator


@reads(lambda cuda_home, venv_dir, **_: [(CudaStack, {
    "cuda_home": cuda_home,
    "venv_dir": venv_dir,
})])
@operation()
@refusals_fail_the_host
def torch_matches_nvcc(cuda_home: str, venv_dir: str):
    """PyTorch's extension builder refuses an nvcc whose major differs from torch's CUDA."""
    stack = read(CudaStack, cuda_home=cuda_home, venv_dir=venv_dir)
    if not stack["torch_cuda"]:
        _fail(f"torch in {venv_dir} reports no CUDA version (a CPU-only build?)")
    if not stack["nvcc"] or stack["nvcc"].split(".")[0] != stack["torch_cuda"].split(".")[0]:
        _fail(f"torch in {venv_dir} is built for CUDA {stack['torch_cuda']} but "
              f"{cuda_home}/bin/nvcc is {stack['nvcc']}: majors must match "
              "(check the card profile's pip index)")
    host.noop(f"torch CUDA {stack['torch_cuda']} matches nvcc {stack['nvcc']}")
    return
    yield


@reads(lambda dest, ref, **_: [(GitCheckout, {"dest": dest, "ref": ref})])
@operation()
def git_checkout(url: str, ref: str, dest: str):
    """A clean checkout of `ref` (tag or commit) in `dest`, detached, cloned if absent."""
    state = read(GitCheckout, dest=dest, ref=ref)
    if state["head"] and state["head"] == state["ref"] and not state["dirty"]:
        host.noop(f"{dest} is at {ref}")
        return
    q_dest, q_url, q_ref = shlex.quote(dest), shlex.quote(url), shlex.quote(ref)
    if not state["head"]:
        # Clone next to the destination and move it in: a killed clone leaves no partial repo.
        yield (f"rm -rf {q_dest}.clone && git clone -q {q_url} {q_dest}.clone && "
               f"mv {q_dest}.clone {q_dest}")
    yield (f"git -C {q_dest} fetch -q --tags {q_url} && "
           f"git -C {q_dest} checkout -q --force --detach {q_ref}")


def tree_archive(local_dir: Path) -> tuple[bytes, str]:
    """A reproducible tar.gz of a local source tree and its content digest."""
    buffer = io.BytesIO()
    digest = hashlib.sha256()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(local_dir.rglob("*")):
            rel = path.relative_to(local_dir)
            if set(rel.parts) & {".git", "__pycache__", ".pytest_cache"} or rel.suffix == ".pyc":
                continue
            info = tar.gettarinfo(str(path), arcname=str(rel))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if path.is_file():
                data = path.read_bytes()
                digest.update(str(rel).encode() + b"\0" + data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buffer.getvalue(), digest.hexdigest()


@reads(lambda dest, **_: [(PathStates, {
    "paths": [f"{dest}/.uncloseai-tree"],
    "digest": [f"{dest}/.uncloseai-tree"],
})])
@operation()
def source_tree(local_dir: str, dest: str):
    """Ship a directory from the operator's machine; swapped in whole, stamped with its digest."""
    archive, digest = tree_archive(Path(local_dir))
    stamp = f"{dest}/.uncloseai-tree"
    state = read(PathStates, paths=[stamp], digest=[stamp]).get(stamp, {})
    if state.get("sha256") == hashlib.sha256(digest.encode()).hexdigest():
        host.noop(f"{dest} matches {local_dir}")
        return
    tmp = f"{dest}.upload.tar.gz"
    yield FileUploadCommand(io.BytesIO(archive), tmp)
    q = shlex.quote(dest)
    yield (f"rm -rf {q}.new && mkdir -p {q}.new && tar -xzf {shlex.quote(tmp)} -C {q}.new && "
           f"printf %s {digest} > {q}.new/.uncloseai-tree && rm -rf {q}.old && "
           f"{{ [ ! -e {q} ] || mv {q} {q}.old; }} && mv {q}.new {q} && rm -rf {q}.old {tmp}")


@reads(lambda venv_dir, source_dir, **_: [(EditableInstall, {
    "venv_dir": venv_dir,
    "source_dir": source_dir,
})])
@operation()
def editable_install(venv_dir: str, source_dir: str, reinstall: list[OperationMeta]):
    """`pip install --no-deps -e` unless already installed editable from there and unchanged."""
    if not any(op.did_change() for op in reinstall) and read(
            EditableInstall, venv_dir=venv_dir, source_dir=source_dir):
        host.noop(f"{source_dir} is installed editable")
        return
    yield f"{venv_dir}/bin/pip install -q --no-deps -e {shlex.quote(source_dir)}"


@reads(lambda venv_dir, cuda_home, stamp, **_: [
    (Exllamav3Stack, {"venv_dir": venv_dir, "stamp": stamp}),
    (CudaStack, {"cuda_home": cuda_home, "venv_dir": venv_dir}),
])
@operation()
@refusals_fail_the_host
def exllamav3_wheel(version: str, ref: str, git_url: str, patches: list[str], arch: str,
                    venv_dir: str, cuda_home: str, service_user: str, cache_dir: str,
                    box_dir: str, source_dir: str, script: str, stamp: str,
                    gib_per_job: float, distro: str):
    """The exllamav3 wheel of this box's stack, installed; built at most once per stack.

    Converged (the stamp names this stack): nothing, unless the operator's cache lacks the wheel
    and the box still has it (then it is copied back). Cache hit: upload, verify on the box,
    install (no compiler runs). Cache miss: build on the box, verify, install, copy back. The
    stamp is removed before and written after an install, so a failed install is retried."""
    box = {**read(Exllamav3Stack, venv_dir=venv_dir, stamp=stamp),
           **read(CudaStack, cuda_home=cuda_home, venv_dir=venv_dir), "distro": distro}
    missing = [k for k in ("abi", "torch", "torch_cuda", "nvcc", "machine") if not box[k]]
    if missing:
        _fail(f"cannot key the exllamav3 wheel: {', '.join(missing)} not found "
              f"(venv {venv_dir}, toolkit {cuda_home})")
    key = wheel_cache.stack_key(version, ref, wheel_cache.patches_digest(patches), arch, box)
    stack = wheel_cache.stack_id(key)
    wheel = wheel_cache.wheel_name(version, box["abi"], box["machine"])
    entry = wheel_cache.resolve(cache_dir) / "exllamav3" / stack
    remote_dir = f"{box_dir}/{stack}"
    remote_wheel = f"{remote_dir}/{wheel}"
    copy_back = [
        FunctionCommand(wheel_cache.prepare_entry, (str(entry),), {}),
        FileDownloadCommand(remote_wheel, str(entry / f".{wheel}.download")),
        FileDownloadCommand(f"{remote_wheel}.sha256", str(entry / f".{wheel}.sha256.download")),
        FunctionCommand(wheel_cache.commit_entry, (str(entry), wheel, key), {}),
    ]
    if box["installed"] == key:
        # Converged: the cache entry is looked for, not hashed (a real wheel is tens of MB, on
        # every run, for every host); its bytes are checked whenever one is uploaded.
        if wheel_cache.has_entry(entry, wheel) or not read(File, path=f"{remote_wheel}.sha256"):
            host.noop(f"exllamav3 installed for stack {stack}")
            return
        yield from copy_back
        return
    try:
        cached = wheel_cache.cached_wheel(entry, wheel)
    except wheel_cache.WheelCacheError as exc:
        _fail(str(exc))

    q_dir, q_wheel, q_stamp = shlex.quote(remote_dir), shlex.quote(wheel), shlex.quote(stamp)
    if cached:
        path, digest = cached
        yield StringCommand("mkdir", "-p", remote_dir)
        yield FileUploadCommand(str(path), f"{remote_wheel}.part")
        yield (f"cd {q_dir} && if echo {shlex.quote(f'{digest}  {wheel}.part')} | "
               f"sha256sum -c --quiet; then mv -f {q_wheel}.part {q_wheel} && "
               f"echo {shlex.quote(f'{digest}  {wheel}')} > {q_wheel}.sha256; else "
               f"rm -f {q_wheel}.part; echo 'uploaded {wheel} does not match the cache sha256 "
               f"{digest}: not installed' >&2; exit 1; fi")
    else:
        env = {"GIT_URL": git_url, "REF": ref, "SRC": source_dir, "VENV": venv_dir,
               "CUDA_HOME": cuda_home, "ARCH": arch, "GIB_PER_JOB": gib_per_job,
               "OUT_DIR": remote_dir, "WHEEL": wheel,
               "PATCHES": " ".join(f"{source_dir}-patches/{Path(p).name}" for p in patches)}
        assignments = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items())
        yield f"env {assignments} sh {shlex.quote(script)}"
    # Verified on the box before pip sees it; the import check runs as the service user with no
    # compiler on PATH and no CUDA_HOME: exllamav3_ext is the compiled module or nothing.
    check = "import torch, exllamav3_ext; print(exllamav3_ext.__file__)"
    yield (f"cd {q_dir} && if ! sha256sum -c --quiet {q_wheel}.sha256; then "
           f"echo '{remote_wheel} fails its sha256: not installed' >&2; "
           f"rm -f {q_wheel} {q_wheel}.sha256; exit 1; fi && rm -f {q_stamp} && "
           f"{venv_dir}/bin/pip install -q --no-deps --force-reinstall {q_wheel} && "
           f"runuser -u {shlex.quote(service_user)} -- env -i PATH=/usr/bin:/bin HOME=/tmp "
           f"{venv_dir}/bin/python -c {shlex.quote(check)} && "
           f"mkdir -p {shlex.quote(str(Path(stamp).parent))} && "
           f"printf '%s\\n' {shlex.quote(key)} > {q_stamp}.tmp && mv {q_stamp}.tmp {q_stamp}")
    if not cached:
        yield from copy_back


@reads(lambda unit, depends_on, record, **_: [(UnitState, {
    "unit": unit,
    "depends_on": depends_on,
    "record": record,
})])
@operation()
def vllm_service(unit: str, depends_on: list[str], record: str):
    """Enabled, running, and running what is on disk now. The digest of its dependencies
    (unit file, venv's distributions, plugin, exllamav3) is recorded at each start; a
    mismatch means a restart is due, including one that a failed run left undone."""
    state = read(UnitState, unit=unit, depends_on=depends_on, record=record)
    if state.get("NeedDaemonReload") == "yes" or state.get("LoadState") != "loaded":
        yield "systemctl daemon-reload"
    if state.get("UnitFileState") != "enabled":
        yield f"systemctl enable -q {unit}"
    running = state.get("ActiveState") in ("active", "activating", "reloading")
    if running and state.get("Recorded") == state.get("OnDisk"):
        host.noop(f"{unit} is running what is installed")
        return
    # Digest taken before the restart: a change landing during the restart stays detectable.
    yield (f"mkdir -p {Path(record).parent} && {digest_command(depends_on)} > {record}.tmp && "
           f"systemctl restart {unit} && mv {record}.tmp {record}")


def _unit_and_file(unit: str, path: str) -> Request:
    """A unit's state and whether `path` exists, in one command."""
    return UnitState, {"unit": unit, "present": path}


@reads(lambda unit, pending_marker, **_: [_unit_and_file(unit, pending_marker)])
@operation()
def reloaded_service(unit: str, pending_marker: str, restart: bool = False):
    """Enabled and running; reloaded when a config swap left the marker behind (`restart`:
    restarted instead, after a daemon-reload: for a change to the unit itself)."""
    state = read_request(_unit_and_file(unit, pending_marker))
    pending = state.get("Present") == "yes"
    q_unit, q_marker = shlex.quote(unit), shlex.quote(pending_marker)
    if state.get("UnitFileState") != "enabled":
        yield f"systemctl enable {q_unit}"
    if state.get("ActiveState") != "active":
        yield f"systemctl restart {q_unit} && rm -f {q_marker}"
    elif pending and restart:
        yield f"systemctl daemon-reload && systemctl restart {q_unit} && rm -f {q_marker}"
    elif pending:
        yield f"systemctl reload-or-restart {q_unit} && rm -f {q_marker}"
    else:
        host.noop(f"{unit} is running its current config")


@operation()
@refusals_fail_the_host
def host_matches_inventory(profile: dict, supported_distros: list[str], card: dict,
                           require_nvidia_smi: bool, driver_minimum: str):
    """Refuse a box whose distro, GPU or NVIDIA driver (`profile`: the HostProfile fact) is not
    what the inventory's card profile needs, before anything is installed on it."""
    if profile["distro"] not in supported_distros:
        _fail(f"distro {profile['distro'] or 'unknown'} is not supported "
              f"(supported: {', '.join(supported_distros)})")
    gpus = profile["gpus"]
    if gpus is None:
        if require_nvidia_smi:
            _fail("nvidia-smi not found: install the NVIDIA driver first "
                  f"({driver_minimum} or newer for card profile '{card['name']}')")
        host.noop("no nvidia-smi here (require_nvidia_smi is off): GPU not checked")
        return
    if profile["nvidia_smi_error"] or not gpus:
        _fail("nvidia-smi is present but lists no GPU (driver not loaded?)")
    named = [g for g in gpus if g.get("name") == card["gpu_name"]]
    if not named:
        found = "; ".join(f"{g.get('name')} (compute {g.get('compute_cap')})" for g in gpus)
        _fail(f"inventory says card '{card['name']}' ({card['gpu_name']}, compute "
              f"{card['arch']}) but nvidia-smi reports {found}")
    gpu = next((g for g in named if g.get("compute_cap") == card["arch"]), None)
    if gpu is None:
        _fail(f"nvidia-smi reports {card['gpu_name']} with compute capability "
              f"{named[0].get('compute_cap')}, card profile '{card['name']}' is built for "
              f"{card['arch']}")
    driver = gpu.get("driver_version")
    if not driver_at_least(driver, driver_minimum):
        _fail(f"NVIDIA driver {driver or 'unknown'} is older than {driver_minimum}, the minimum "
              f"for CUDA {card['cuda']} (card profile '{card['name']}'): upgrade the driver; "
              "nothing was installed")
    host.noop(f"{card['name']} present, driver {driver} (>= {driver_minimum}), "
              f"distro {profile['distro']}")
    return
    yield


def driver_at_least(found: str | None, minimum: str) -> bool:
    """NVIDIA driver versions compare as dotted numbers (580.65.06 >= 580.65.6 > 570.195)."""
    def numbers(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))
    try:
        return found is not None and numbers(found) >= numbers(minimum)
    except ValueError:
        return False


@reads(lambda provides, **_: [(PathStates, {"paths": [provides]})])
@operation()
def deb_from_url(url: str, provides: str, lock_wait: int = 600):
    """Install a .deb fetched from `url` unless the file it provides is already there (apt
    waits for its locks as in apt_install)."""
    if read(PathStates, paths=[provides]).get(provides):
        host.noop(f"{provides} present")
        return
    tmp = f"/tmp/uncloseai-{hashlib.sha256(url.encode()).hexdigest()[:12]}.deb"
    yield (f"{APT_FUNCTIONS}curl -fsSL --retry 3 -o {tmp} {shlex.quote(url)} && "
           f"{_apt_get(lock_wait, f'install -y -q {tmp}')}; rc=$?; rm -f {tmp}; exit $rc")


@reads(lambda unit, unit_path, **_: [_unit_and_file(unit, unit_path)])
@operation()
def retired_unit(unit: str, unit_path: str):
    """Stop, disable and remove the unit of a model identity this box no longer serves."""
    state = read_request(_unit_and_file(unit, unit_path))
    if state.get("Present") != "yes" and state.get("LoadState") != "loaded":
        host.noop(f"{unit} is not installed")
        return
    yield (f"systemctl disable -q --now {unit} || true; rm -f {unit_path} && "
           "systemctl daemon-reload")
