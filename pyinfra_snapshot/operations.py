"""Generic operations: each yields no command when the host already matches (a converged host
reports zero changes) and leaves nothing half-done when interrupted. Every value that reaches a
shell is quoted."""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import FileUploadCommand
from pyinfra.api.output import format_text
from pyinfra.context import ctx_host
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import generate_color_diff

from pyinfra_snapshot.facts import (
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
from pyinfra_snapshot.operation import fail, operation
from pyinfra_snapshot.snapshot import need

# `apt_get_when_free WAIT ARGS...` (apt_get.sh): apt-get once apt's and dpkg's locks are free
# (waiting up to WAIT s, said on stderr), after finishing an interrupted dpkg. Prepended to each
# apt command.
APT_FUNCTIONS = (Path(__file__).resolve().parent / "apt_get.sh").read_text()


def _apt_get(lock_wait: int, *commands: str) -> str:
    """Shell running `apt-get <command>` for each, in order, through apt_get_when_free (the
    caller puts APT_FUNCTIONS first)."""
    return " && ".join(f"apt_get_when_free {int(lock_wait)} {c}" for c in commands)


q = shlex.quote


def _owner(user: str, group: str) -> str:
    return q(f"{user}:{group}")


def _same_mode(found: str, mode: str) -> bool:
    return found == mode.lstrip("0")


@operation(installed=lambda op: need(DebStatus, packages=op.packages))
def apt_install(packages: list[str], installed: set[str], lock_wait: int = 600):
    """Install the missing packages; refresh the lists only when something is missing. Each
    apt-get waits (up to `lock_wait` s) for apt's and dpkg's locks, and an interrupted dpkg is
    finished first (apt_get.sh)."""
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"installed: {' '.join(packages)}")
        return
    yield APT_FUNCTIONS + _apt_get(lock_wait, "update -q",
                                   f"install -y -q {' '.join(map(q, missing))}")


def diffing() -> bool:
    """Whether the run shows text diffs (pyinfra's --diff), from the host's State (pyinfra's
    `config` context is not set in the greenlets that execute operations)."""
    run_state = getattr(ctx_host.get(), "state", None)
    return bool(run_state is not None and run_state.config.DIFF)


def show_diff(dest: str, current: list[str] | None, content: str) -> None:
    """What pyinfra's files.put shows under --diff: the file and its changed lines."""
    verb = "modify" if current is not None else "create"
    host.log(f"Will {verb} {format_text(dest, bold=True)}", logger.info)
    for line in generate_color_diff([line + "\n" for line in current or []],
                                    content.splitlines(keepends=True)):
        logger.info("  %s", line)
    logger.info("")


@operation(
    current=lambda op: need(PathStates, paths=[op.dest], digest=[op.dest]),
    current_text=lambda op: need(FileContents, path=op.dest)
    if diffing() and not op.secret else None,
)
def config_file(content: str, dest: str, current: dict, current_text: list[str] | None,
                mode: str = "644", user: str = "root", group: str = "root",
                validate: str | None = None, pending_marker: str | None = None,
                secret: bool = False):
    """Install `content` at `dest` via a staged copy: validated (`{path}` in `validate` names the
    staged file, quoted) before it replaces the live one; `pending_marker` is touched before the
    swap so a reload that was due survives a run that dies right after it. Under --diff the
    changed lines are shown, as files.put shows them, unless the content is `secret` (a token):
    then only that it changes."""
    want = hashlib.sha256(content.encode()).hexdigest()
    state_now = current.get(dest, {})
    same_content = (state_now.get("type", "").startswith("regular")
                    and state_now.get("sha256") == want)
    if (same_content and _same_mode(state_now["mode"], mode)
            and (state_now["user"], state_now["group"]) == (user, group)):
        host.noop(f"{dest} is current")
        return
    if diffing() and not same_content:
        if secret:
            host.log(f"Will change {dest}: secret content, not shown", logger.info)
        else:
            show_diff(dest, current_text, content)
    # Staged in a fresh private directory beside `dest` (0700, the login user's, never a
    # world-readable temporary file: pyinfra's upload for a sudo login goes through
    # remote_temp_filename, placed in it too). The staged file keeps dest's name, so a validator
    # that reads the suffix (systemd-analyze verify: .service) sees it; the final mv is a rename
    # within one file system. Leftovers of an interrupted run are removed first.
    parent, name = str(Path(dest).parent), Path(dest).name
    stage_dir = f"{parent}/.pyinfra-stage-{want[:12]}"
    staged = f"{stage_dir}/{name}"
    q_dir, q_staged, q_dest, q_parent = q(stage_dir), q(staged), q(dest), q(parent)
    login = q(host.data.get("ssh_user") or "root")
    yield (f"mkdir -p {q_parent} && rm -rf {q_parent}/.pyinfra-stage-* "
           f"&& mkdir -m 700 {q_dir} && chown {login} {q_dir}")
    yield FileUploadCommand(io.BytesIO(content.encode()), staged,
                            remote_temp_filename=f"{stage_dir}/.upload")
    # Once the file has its owner and mode, the directory opens to traversal (0711): a validator
    # running as another user (caddy) can read the file if the file's own mode lets it.
    steps = [f"chown {_owner(user, group)} {q_staged}", f"chmod {q(mode)} {q_staged}",
             f"chmod 711 {q_dir}"]
    if validate:
        steps.append(f"{{ {validate.format(path=q_staged)}; }}")
    if pending_marker:
        steps.append(f"mkdir -p {q(str(Path(pending_marker).parent))} && "
                     f"touch {q(pending_marker)}")
    steps.append(f"mv -f {q_staged} {q_dest} && rmdir {q_dir}")
    yield " && ".join(steps) + f" || {{ rc=$?; rm -rf {q_dir}; exit $rc; }}"


@operation(found=lambda op: need(PathStates, paths=op.paths))
def directories(paths: list[str], found: dict, user: str = "root", group: str = "root",
                mode: str = "755"):
    """Directories with this owner and mode, all checked in one command."""
    wrong = []
    for path in paths:
        path_state = found.get(path)
        if path_state and path_state["type"] != "directory":
            fail(f"{path} exists and is a {path_state['type']}, not a directory")
        if not path_state or (path_state["user"], path_state["group"]) != (user, group) or (
                not _same_mode(path_state["mode"], mode)):
            wrong.append(q(path))
    if not wrong:
        host.noop(f"{len(paths)} directories in place")
        return
    listing = " ".join(wrong)
    yield (f"mkdir -p {listing} && chown {_owner(user, group)} {listing} && "
           f"chmod {q(mode)} {listing}")


@operation(found=lambda op: need(PathStates, paths=[op.path]))
def owned_file(path: str, user: str, group: str, mode: str, found: dict):
    """A file (created empty, its content is not ours: a log) with this owner and mode."""
    path_state = found.get(path)
    if path_state and not path_state["type"].startswith("regular"):
        fail(f"{path} exists and is a {path_state['type']}, not a file")
    if path_state and (path_state["user"], path_state["group"]) == (user, group) and (
            _same_mode(path_state["mode"], mode)):
        host.noop(f"{path} in place")
        return
    yield (f"mkdir -p {q(str(Path(path).parent))} && touch {q(path)} && "
           f"chown {_owner(user, group)} {q(path)} && chmod {q(mode)} {q(path)}")


@operation(found=lambda op: need(PathStates, paths=[op.path]))
def absent_path(path: str, found: dict):
    """No file (or link) at `path`; read through the snapshot, so a converged run adds no
    remote command (stock files.file(present=False) reads its own File fact)."""
    if not found.get(path):
        host.noop(f"{path} absent")
        return
    yield f"rm -f -- {q(path)}"


@operation(found=lambda op: need(PathStates, paths=[f"{op.path}/bin/activate"]))
def python_venv(path: str, python: str, found: dict):
    """A venv made by `python -m venv` (again, in place, when bin/activate is missing: venv
    writes it last, so a venv whose creation was interrupted is completed)."""
    if found:
        host.noop(f"venv {path} present")
        return
    yield f"{q(python)} -m venv {q(path)}"


@operation(account=lambda op: need(UserAccount, user=op.user))
def system_user(user: str, home: str, shell: str, account: dict | None):
    """A system user with this home (created, owned by the user) and login shell."""
    q_user, q_home, q_shell = q(user), q(home), q(shell)
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


@operation(installed=lambda op: need(VenvDistributions, venv_dir=op.venv_dir),
           busy=lambda op: need(PathStates, paths=[f"{op.venv_dir}/{op.busy_marker}"])
           if op.uv else None)
def venv_packages(venv_dir: str, packages: list[str], installed: dict[str, str],
                  busy: dict | None, install_args: list[str] | None = None,
                  install: list[str] | None = None, uv: str | None = None,
                  busy_marker: str = ".installing"):
    """Each requirement (`name==version` and the like) satisfied in the venv (the distributions
    its site-packages holds); the installer installs them all together when any is not, so its
    resolver sees the whole set: `install` when given (the same requirements, some as direct
    references: `name @ <wheel URL>`), else `packages`. `install_args`: the installer's own
    options (e.g. --index-url URL), each an argument.

    `uv` (a requirement, `uv==0.13.9`): install with uv, itself installed into the venv by the
    venv's pip from the same index when the venv lacks that version (so the box needs no other
    source); uv uses the box's own certificate store, as pip does. None: the venv's pip.
    uv installs a set's distributions in parallel, in no order: killed midway, it can leave the
    requirements' distributions in place without all of their own dependencies' files (seen on
    the testbed: torch present, libcusparseLt.so.0 missing). So with uv a marker
    (`<venv>/<busy_marker>`) is made before installing and removed once uv succeeded; a
    venv that has it is not converged, and the next install is `--reinstall` (every
    distribution of the set laid out again, from uv's cache). The marker is read through the
    snapshot: no extra remote command."""
    from packaging.requirements import InvalidRequirement, Requirement

    def parsed(spec: str) -> Requirement:
        try:
            return Requirement(spec)
        except InvalidRequirement as exc:
            fail(f"venv package {spec!r} is not a pip requirement: {exc}")

    def met(requirement: Requirement) -> str | None:
        """None when satisfied, else what the venv has."""
        version = installed.get(normalized_name(requirement.name))
        # `==2.11.0` accepts 2.11.0+cu130, as pip does: the index's local tag is not a mismatch.
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            return f"{requirement.name} ({version or 'absent'})"
        return None

    unmet = [m for m in (met(parsed(spec)) for spec in packages) if m]
    args, marker = install_args or [], f"{venv_dir}/{busy_marker}"
    interrupted = uv is not None and marker in (busy or {})
    if not unmet and not interrupted:
        host.noop(f"{len(packages)} requirements met in {venv_dir}")
        return
    pip, specs = q(f"{venv_dir}/bin/pip"), [*map(q, install or packages)]
    if uv is None:
        yield " ".join([pip, "install", "-q", *map(q, args), *specs])
        return
    steps = [f"touch {q(marker)}"]
    if met(parsed(uv)):
        # From the same index as the rest (PyPI, or the operator's mirror of it).
        index = args[args.index("--index-url"):][:2] if "--index-url" in args else []
        steps.append(" ".join([pip, "install", "-q", *map(q, index), q(uv)]))
    steps.append(" ".join([q(f"{venv_dir}/bin/uv"), "pip", "install", "--python",
                           q(f"{venv_dir}/bin/python"), "-q", "--system-certs",
                           *(["--reinstall"] if interrupted else []), *map(q, args), *specs]))
    steps.append(f"rm -f {q(marker)}")
    yield " && ".join(steps)


@operation(checkout=lambda op: need(GitCheckout, dest=op.dest, ref=op.ref))
def git_checkout(url: str, ref: str, dest: str, checkout: dict):
    """A clean checkout of `ref` (tag or commit) in `dest`, detached, cloned if absent."""
    if checkout["head"] and checkout["head"] == checkout["ref"] and not checkout["dirty"]:
        host.noop(f"{dest} is at {ref}")
        return
    q_clone, q_dest, q_url, q_ref = q(f"{dest}.clone"), q(dest), q(url), q(ref)
    if not checkout["head"]:
        # Clone next to the destination and move it in: a killed clone leaves no partial repo.
        yield (f"rm -rf {q_clone} && git clone -q {q_url} {q_clone} && "
               f"mv {q_clone} {q_dest}")
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


@operation(stamp=lambda op: need(PathStates, paths=[f"{op.dest}/{op.stamp_name}"],
                                 digest=[f"{op.dest}/{op.stamp_name}"]))
def source_tree(local_dir: str, dest: str, stamp: dict, stamp_name: str = ".tree-stamp"):
    """Ship a directory from the operator's machine; swapped in whole, stamped with its digest
    (the stamp's path: `dest`/`stamp_name`)."""
    archive, digest = tree_archive(Path(local_dir))
    if stamp.get(f"{dest}/{stamp_name}", {}).get("sha256") == hashlib.sha256(
            digest.encode()).hexdigest():
        host.noop(f"{dest} matches {local_dir}")
        return
    tmp, new, old = q(f"{dest}.upload.tar.gz"), q(f"{dest}.new"), q(f"{dest}.old")
    yield FileUploadCommand(io.BytesIO(archive), f"{dest}.upload.tar.gz")
    yield (f"rm -rf {new} && mkdir -p {new} && tar -xzf {tmp} -C {new} && "
           f"printf %s {q(digest)} > {q(f'{dest}.new/{stamp_name}')} && rm -rf {old} && "
           f"{{ [ ! -e {q(dest)} ] || mv {q(dest)} {old}; }} && mv {new} {q(dest)} && "
           f"rm -rf {old} {tmp}")


def editable_install_command(venv_dir: str, source_dir: str) -> str:
    return f"{q(f'{venv_dir}/bin/pip')} install -q --no-deps -e {q(source_dir)}"


@operation(installed=lambda op: need(EditableInstall, venv_dir=op.venv_dir,
                                     source_dir=op.source_dir))
def editable_install(venv_dir: str, source_dir: str, installed: bool):
    """`pip install --no-deps -e` unless some distribution in the venv is installed editable
    from there. (A changed source is reinstalled by a step with `_if=` on the step that
    changed it: see tasks/plugin.py.)"""
    if installed:
        host.noop(f"{source_dir} is installed editable")
        return
    yield editable_install_command(venv_dir, source_dir)


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, present=op.pending_marker))
def reloaded_service(unit: str, pending_marker: str, unit_state: dict, restart: bool = False):
    """Enabled and running; reloaded when a config swap left the marker behind (`restart`:
    restarted instead, after a daemon-reload: for a change to the unit itself)."""
    q_unit, q_marker = q(unit), q(pending_marker)
    if unit_state.get("UnitFileState") != "enabled":
        yield f"systemctl enable {q_unit}"
    if unit_state.get("ActiveState") != "active":
        yield f"systemctl restart {q_unit} && rm -f {q_marker}"
    elif unit_state.get("Present") == "yes" and restart:
        yield f"systemctl daemon-reload && systemctl restart {q_unit} && rm -f {q_marker}"
    elif unit_state.get("Present") == "yes":
        yield f"systemctl reload-or-restart {q_unit} && rm -f {q_marker}"
    else:
        host.noop(f"{unit} is running its current config")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, depends_on=op.depends_on,
                                      record=op.record))
def service_running_its_files(unit: str, depends_on: list[str], record: str, unit_state: dict):
    """Enabled, running, and running what is on disk now. The digest of `depends_on` (paths,
    `*` allowed) is recorded at each start; a mismatch means a restart is due, including one
    that a failed run left undone."""
    q_unit, q_record = q(unit), q(record)
    if unit_state.get("NeedDaemonReload") == "yes" or unit_state.get("LoadState") != "loaded":
        yield "systemctl daemon-reload"
    if unit_state.get("UnitFileState") != "enabled":
        yield f"systemctl enable -q {q_unit}"
    running = unit_state.get("ActiveState") in ("active", "activating", "reloading")
    if running and unit_state.get("Recorded") == unit_state.get("OnDisk"):
        host.noop(f"{unit} is running what is installed")
        return
    # Digest taken before the restart: a change landing during the restart stays detectable.
    yield (f"mkdir -p {q(str(Path(record).parent))} && {digest_command(depends_on)} > "
           f"{q(record + '.tmp')} && systemctl restart {q_unit} && "
           f"mv {q(record + '.tmp')} {q_record}")


@operation(found=lambda op: need(PathStates, paths=[op.provides]))
def deb_from_url(url: str, provides: str, found: dict, lock_wait: int = 600):
    """Install a .deb fetched from `url` unless the file it provides is already there (apt
    waits for its locks as in apt_install)."""
    if found.get(provides):
        host.noop(f"{provides} present")
        return
    tmp = q(f"/tmp/pyinfra-deb-{hashlib.sha256(url.encode()).hexdigest()[:12]}.deb")
    yield (f"{APT_FUNCTIONS}curl -fsSL --retry 3 -o {tmp} {q(url)} && "
           f"{_apt_get(lock_wait, f'install -y -q {tmp}')}; rc=$?; rm -f {tmp}; exit $rc")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, present=op.unit_path))
def retired_unit(unit: str, unit_path: str, unit_state: dict):
    """Stop, disable and remove a unit this host no longer runs."""
    if unit_state.get("Present") != "yes" and unit_state.get("LoadState") != "loaded":
        host.noop(f"{unit} is not installed")
        return
    yield (f"systemctl disable -q --now {q(unit)} || true; rm -f {q(unit_path)} && "
           "systemctl daemon-reload")
