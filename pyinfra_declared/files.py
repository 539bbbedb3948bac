"""Files and directories: a file's content, owner and mode (validated and diffed before it
replaces the live one), directories, a file whose content is not ours, a path that must be
absent. Each yields no command when the host already matches."""

from __future__ import annotations

import hashlib
import io
import shlex
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import FileUploadCommand
from pyinfra.api.output import format_text
from pyinfra.context import ctx_host
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import generate_color_diff

from pyinfra_declared.batched_facts import PathStates, TextFiles
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote


def _owner(user: str, group: str) -> str:
    return q(f"{user}:{group}")


def _same_mode(found: str, mode: str) -> bool:
    return found == mode.lstrip("0")


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


@dataclass(frozen=True)
class ConfigFile:
    """One file of `config_files`: its content and where it goes, with owner and mode; `validate`
    (a command, `{path}` naming the staged file) and `pending_marker` as for `config_file`."""

    content: str
    dest: str
    mode: str = "644"
    user: str = "root"
    group: str = "root"
    validate: str | None = None
    pending_marker: str | None = None
    secret: bool = False


def _install(file: ConfigFile, state_now: dict, current_text: list[str] | None):
    """The commands that put `file` in place, none when the host has it as it should be."""
    want = hashlib.sha256(file.content.encode()).hexdigest()
    dest, mode = file.dest, file.mode
    same_content = (state_now.get("type", "").startswith("regular")
                    and state_now.get("sha256") == want)
    if (same_content and _same_mode(state_now["mode"], mode)
            and (state_now["user"], state_now["group"]) == (file.user, file.group)):
        host.noop(f"{dest} is current")
        return
    if diffing() and not same_content:
        if file.secret:
            host.log(f"Will change {dest}: secret content, not shown", logger.info)
        else:
            show_diff(dest, current_text, file.content)
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
    yield FileUploadCommand(io.BytesIO(file.content.encode()), staged,
                            remote_temp_filename=f"{stage_dir}/.upload")
    # Once the file has its owner and mode, the directory opens to traversal (0711): a validator
    # running as another user (caddy) can read the file if the file's own mode lets it.
    steps = [f"chown {_owner(file.user, file.group)} {q_staged}", f"chmod {q(mode)} {q_staged}",
             f"chmod 711 {q_dir}"]
    if file.validate:
        steps.append(f"{{ {file.validate.format(path=q_staged)}; }}")
    if file.pending_marker:
        steps.append(f"mkdir -p {q(str(Path(file.pending_marker).parent))} && "
                     f"touch {q(file.pending_marker)}")
    steps.append(f"mv -f {q_staged} {q_dest} && rmdir {q_dir}")
    yield " && ".join(steps) + f" || {{ rc=$?; rm -rf {q_dir}; exit $rc; }}"


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
    yield from _install(ConfigFile(content, dest, mode, user, group, validate, pending_marker,
                                   secret), current.get(dest, {}), current_text)


@operation(
    current=lambda op: need(PathStates, paths=[f.dest for f in op.files],
                            digest=[f.dest for f in op.files]),
    current_texts=lambda op: need(TextFiles, paths=[f.dest for f in op.files if not f.secret])
    if diffing() else None,
)
def config_files(files: list[ConfigFile], current: dict, current_texts: dict | None):
    """Several files as `config_file` installs each, in this order, in one operation (one check
    for all of them): what a step installs together (a Caddy's TLS pair, CA and Caddyfile, the
    Caddyfile last so that its validation reads the others). Every file is checked (and, under
    --diff, shown) before the first command: change detection stops at an operation's first
    command, and each changed file's lines must be in the preview."""
    planned = [list(_install(file, current.get(file.dest, {}),
                             (current_texts or {}).get(file.dest))) for file in files]
    for commands in planned:
        yield from commands


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
