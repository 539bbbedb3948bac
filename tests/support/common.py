"""Paths, command running and phase timing shared by the testbed modules."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from donorkit.inventory.paths import REPO_ROOT

if TYPE_CHECKING:  # pydantic: the GPU image's python has none, and gpu/ imports this module
    from donorkit.commands.accept_records import Record

# Everything the testbed makes lives here (git-ignored), so a `rm -rf .testbed` is a full reset.
WORK = REPO_ROOT / ".testbed"
STANDINS = REPO_ROOT / "tests/testbed/standins"
APT_OPTS = ["-o", "DPkg::Lock::Timeout=600"]


def run(cmd: Sequence[str | os.PathLike], check: bool = True, quiet: bool = False,
        **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure show its output (a testbed failure must say why)."""
    args = [str(c) for c in cmd]
    proc = subprocess.run(args, text=True, capture_output=True, **kw)
    if check and proc.returncode != 0:
        msg = f"command failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout}{proc.stderr}"
        raise RuntimeError(msg)
    if not quiet and proc.returncode != 0:
        log(f"(ignored rc={proc.returncode}) {' '.join(args)}: {proc.stderr.strip()[:200]}")
    return proc


def log(msg: str) -> None:
    print(f"[testbed] {msg}", file=sys.stderr, flush=True)


@contextmanager
def phase(name: str, times: dict[str, float] | None = None) -> Iterator[None]:
    """Print (and record) the wall time of one phase: the numbers the brief asks to report."""
    start = time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - start
        if times is not None:
            times[name] = took
        log(f"phase {name}: {took:.1f} s")


def sha256_of(*parts: bytes | str | Path) -> str:
    """Hash of strings, bytes and file contents: the cache keys of built artefacts."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path):
            h.update(p.read_bytes())
        elif isinstance(p, str):
            h.update(p.encode())
        else:
            h.update(p)
        h.update(b"\0")
    return h.hexdigest()


# Where the testbed looks for the commands it needs (sbin too: a non-root PATH may lack it).
TOOL_DIRS = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]


def have(cmd: str) -> bool:
    """Whether `cmd` can be run here (looked up in TOOL_DIRS, then PATH)."""
    dirs = [*TOOL_DIRS, *os.environ.get("PATH", "").split(os.pathsep)]
    return shutil.which(cmd, path=os.pathsep.join(d for d in dirs if d)) is not None


def missing_packages(packages: dict[str, str]) -> list[str]:
    """The packages of {package: command it provides} whose command cannot be found here."""
    return [pkg for pkg, cmd in packages.items() if not have(cmd)]


def apt_install_missing(packages: dict[str, str]) -> None:
    """Install {package: command it provides} where the command is missing (idempotent)."""
    missing = missing_packages(packages)
    if not missing:
        return
    log(f"missing here: {' '.join(missing)}; apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", *APT_OPTS, "install", "-y", *missing]
    if run(install, check=False, quiet=True, env=env).returncode:  # stale lists: update, retry
        run(["apt-get", *APT_OPTS, "update"], env=env)
        run(install, env=env)


def find_pids(match: Callable[[list[str]], bool]) -> list[int]:
    """Pids whose command line matches (exact-path matches only, so only the testbed's own)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "cmdline").read_bytes()
            argv = [a.decode(errors="replace") for a in raw.split(b"\0")]
        except OSError:
            continue
        if match(argv):
            found.append(int(proc.name))
    return found


def unmount_under(path: Path) -> None:
    """Unmount all at or below path, deepest first (a failed debootstrap leaves its /proc)."""
    prefix = str(path.resolve())
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((p for p in points if p == prefix or p.startswith(prefix + "/")),
                        key=len, reverse=True):
        run(["umount", "-l", point], check=False)


def remove_tree(path: Path) -> None:
    """rm -rf that never crosses into a mount (nor deletes through one)."""
    if path.exists() or path.is_symlink():
        unmount_under(path)
        run(["rm", "-rf", "--one-file-system", path])


def make_accept(limit: str, env: dict[str, str] | None = None,
                timeout: float = 1200) -> tuple[Record, str]:
    """`make accept LIMIT=limit` as an operator runs it, with `env` added: its record (named by
    its `record: PATH` line) and its output, printed; a non-zero exit fails with the output."""
    from donorkit.commands.accept_records import Record

    result = subprocess.run(["make", "-s", "accept", f"LIMIT={limit}"], cwd=REPO_ROOT,
                            env={**os.environ, **(env or {})}, capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    print(output[-4000:])
    assert result.returncode == 0, output[-6000:]
    path = next(line.split("record: ", 1)[1] for line in result.stdout.splitlines()
                if line.startswith("record: "))
    return Record.model_validate_json(Path(path).read_text()), output
