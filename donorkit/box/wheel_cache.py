"""The exllamav3 wheel cache: one wheel per card stack, built by the first box of that stack and
kept on the operator's machine for every later box (docs/rerun.md "The exllamav3 wheel cache").

Only a cache builder's wheel is copied back and shipped (`built-by`, written here, never by the
box: a box reports the facts its stack is keyed by, so any box could claim any stack); a wheel
is checked before it is stored and before it is shipped (check_wheel); entries are made only by
rename, sidecar last, under a lock (docs/reference.md "Least privilege on the box").
"""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import io
import os
import re
import shlex
import stat
import zipfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from pyinfra.api import FactBase, FileDownloadCommand

from donorkit.inventory.errors import AnswerTooLarge
from donorkit.inventory.paths import repo_path
from pyinfra_declared.batched_facts import first, sections


class WheelCacheError(Exception):
    """A cached wheel that must not be used; the message names the file."""


# A stack is everything that decides the compiled wheel: exllamav3's version, git ref and the
# patches applied to it (inventory data), and from the box (facts, read when the operation runs):
# the venv's Python ABI, torch's version with its CUDA variant, nvcc's release, the card's arch
# (data), the distro (glibc/libstdc++ the wheel links against) and the CPU architecture.
# Cache layout (on the operator's machine, under the git-ignored `exllamav3_wheel_cache`):
#     <cache>/exllamav3/<stack id>/exllamav3-1.5.1-cp312-cp312-linux_x86_64.whl
#     <cache>/exllamav3/<stack id>/exllamav3-1.5.1-cp312-cp312-linux_x86_64.whl.sha256
#     <cache>/exllamav3/<stack id>/stack.txt          (the stack key, for people)
#     <cache>/exllamav3/<stack id>/built-by           (the box it came from: its inventory name)
# The sidecar is `sha256sum` output, checked before an upload (here) and after it (on the box,
# before pip sees the file). Each box downloads under its own temporary names (download_names):
# boxes of one stack copying back in one run do not collide; the first whole copy is the entry.

# The entry's builder: the inventory name of the box it was copied back from.
BUILT_BY = "built-by"
# What a wheel copied back may hold, unpacked: exllamav3 1.5.1's for one arch is tens of MB.
WHEEL_MAX_BYTES = 2 << 30
WHEEL_MAX_FILES = 20_000
# The compiled extension, beside the package (setup.py: CUDAExtension("exllamav3_ext", ...)).
EXTENSION = re.compile(r"exllamav3_ext\.[A-Za-z0-9_.-]+\.so")


class Exllamav3Stack(FactBase):
    """What the box contributes to the exllamav3 stack key, besides nvcc's release and torch's
    CUDA version (CudaStack, read once for this and the toolkit checks) and the distro
    (HostProfile, read once when the deploy loads), and the stack it has installed.

    Cheap: the Python ABI comes from the venv's pyvenv.cfg, torch's version from its version.py
    (found in the venv's site-packages, no Python started). `wheels`: the verified wheels the
    box holds under `box_dir` (`<stack id>/<wheel>`, those with their sha256 sidecar).
    """

    def command(self, venv_dir: str, stamp: str, box_dir: str) -> str:
        venv, box = shlex.quote(venv_dir), shlex.quote(box_dir)
        return (
            # The first match only (pyvenv.cfg has version and version_info): sed quits there.
            "echo @@python; sed -n "
            "'/^version\\(_info\\)\\? *= *\\([0-9]*\\.[0-9]*\\).*/{s//\\2/p;q}' "
            f"{venv}/pyvenv.cfg 2>/dev/null; "
            "echo @@torch; sed -n \"s/^__version__ *= *'\\(.*\\)'.*/\\1/p\" "
            f"{venv}/lib/python3*/site-packages/torch/version.py 2>/dev/null; "
            "echo @@machine; uname -m; "
            f"echo @@installed; cat {shlex.quote(stamp)} 2>/dev/null; echo; "
            f"echo @@wheels; cd {box} 2>/dev/null && "
            "for f in */*.whl.sha256; do [ ! -e \"$f\" ] || echo \"${f%.sha256}\"; done; true"
        )

    def process(self, output: list[str]) -> dict:
        found = sections(output)
        python = first(found, "python")
        return {"python": python,
                "abi": f"cp{python.replace('.', '')}" if python else None,
                "torch": first(found, "torch"), "machine": first(found, "machine"),
                "installed": first(found, "installed"),
                "wheels": sorted(line for line in found.get("wheels", []) if line)}


def patches_digest(paths: list[str]) -> str:
    """Short digest of the patch files' diffs, in order ('none' without patches)."""
    if not paths:
        return "none"
    digest = hashlib.sha256()
    for path in paths:
        text = repo_path(path).read_bytes()
        start = text.find(b"diff ")  # the comment above the diff is not part of the build
        digest.update(text[max(start, 0):])
    return digest.hexdigest()[:12]


def stack_key(version: str, ref: str, patches: str, arch: str, box: dict) -> str:
    """One line naming everything the wheel depends on."""
    return (f"exllamav3-{version}@{ref}+patches-{patches} {box['abi']} torch-{box['torch']} "
            f"cuda-{box['torch_cuda']} nvcc-{box['nvcc']} sm-{arch} {box['distro']} "
            f"{box['machine']}")


def stack_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def wheel_name(version: str, abi: str, machine: str) -> str:
    """What setuptools names a CPython extension wheel built on Linux."""
    return f"exllamav3-{version}-{abi}-{abi}-linux_{machine}.whl"


# The most a sidecar copied back may be (one sha256sum line); a wheel's is WHEEL_MAX_BYTES, a
# kernel archive's kernel_cache.ARCHIVE_MAX_BYTES: what the checks accept is what is copied.
SIDECAR_MAX_BYTES = 4096


class CappedDownload(FileDownloadCommand):
    """pyinfra's FileDownloadCommand with a limit: a box's file copied back to this machine is
    refused past `limit` bytes (the partial copy removed, this host failed with one line), so a
    box cannot fill the operator's disk whatever it says about the file's size."""

    def __init__(self, src: str, dest: str, limit: int, **kwargs) -> None:
        super().__init__(src, dest, **kwargs)
        self.limit = limit

    def __repr__(self) -> str:
        return f"FileDownloadCommand({self.src}, {self.dest}, at most {self.limit} bytes)"

    def execute(self, state, host, connector_arguments) -> bool:
        import io

        src, dest, limit = self.src, Path(self.dest), self.limit

        class Capped(io.RawIOBase):
            """The local file, refusing a write past the limit."""

            def __init__(self, stream) -> None:
                super().__init__()
                self.stream, self.size = stream, 0

            def writable(self) -> bool:
                return True

            def seekable(self) -> bool:
                return True

            def seek(self, offset: int, whence: int = 0) -> int:
                self.size = self.stream.seek(offset, whence)  # pyinfra rewinds before writing
                return self.size

            def write(self, data: bytes) -> int:
                self.size += len(data)
                if self.size > limit:
                    raise AnswerTooLarge(f"{src}: more than {limit} bytes")
                return self.stream.write(data)

        connector_arguments.update(self.connector_arguments)
        try:
            with dest.open("wb") as stream:  # as FileDownloadCommand.execute, into Capped
                return host.get_file(src, Capped(stream),
                                     remote_temp_filename=self.remote_temp_filename,
                                     print_output=state.print_output,
                                     print_input=state.print_input, **connector_arguments)
        except AnswerTooLarge as exc:
            dest.unlink(missing_ok=True)
            return _refuse(host, f"{exc}: not copied back")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sidecar_sha256(sidecar: Path, wheel: str) -> str:
    """The digest a `sha256sum` sidecar records for `wheel`."""
    with sidecar.open("rb") as stream:  # a line; the box may have sent anything
        fields = stream.read(4096).decode("utf-8", "replace").split()
    if len(fields) != 2 or fields[1].lstrip("*") != wheel or len(fields[0]) != 64:
        raise WheelCacheError(f"{sidecar}: not a sha256sum line for {wheel}")
    return fields[0]


def has_entry(entry_dir: Path, wheel: str) -> bool:
    """Whether the entry is complete (its sidecar, written last, exists), without reading it."""
    return (entry_dir / wheel).is_file() and (entry_dir / f"{wheel}.sha256").is_file()


def cached_wheel(entry_dir: Path, wheel: str) -> tuple[Path, str] | None:
    """(path, sha256) of a verified cached wheel; None when the entry is absent or incomplete
    (no sidecar yet). A wheel that does not match its sidecar raises WheelCacheError."""
    path, sidecar = entry_dir / wheel, entry_dir / f"{wheel}.sha256"
    if not has_entry(entry_dir, wheel):
        return None
    want = sidecar_sha256(sidecar, wheel)
    found = file_sha256(path)
    if found != want:
        raise WheelCacheError(
            f"cached {path} is corrupt: sha256 {found}, its sidecar says {want}; "
            "delete that directory and run again (the next box of this stack rebuilds it)")
    return path, want


def entry_builder(entry_dir: Path) -> str | None:
    """The box an entry came from, as recorded on the operator's machine; None: unrecorded."""
    try:
        with (entry_dir / BUILT_BY).open("rb") as stream:
            return stream.read(256).decode("ascii", "replace").strip() or None
    except FileNotFoundError:
        return None


def distrusted(entry_dir: Path, builders: Collection[str]) -> str | None:
    """Why a complete entry must not go to another box (None: it may): it was not copied back
    from a box that is a cache builder now."""
    builder = entry_builder(entry_dir)
    if builder is None:
        return "has no record of the box that built it (an older run's)"
    if builder not in builders:
        return f"was built by '{builder[:64]}', which is not a cache builder (cache_builder: true)"
    return None


def trusted_entry(entry_dir: Path, wheel: str, builders: Collection[str]) -> bool:
    """A complete entry from a current cache builder (not read beyond its record)."""
    return has_entry(entry_dir, wheel) and distrusted(entry_dir, builders) is None


PLAIN_NAME = re.compile(r"[\w./+@=,-]{1,200}", re.ASCII)


def shown(name: str) -> str:
    """A file name from a box's archive, for one line on the operator's terminal: as it is when
    plain, else escaped (no control character reaches the terminal) and cut to 200 characters."""
    return name if PLAIN_NAME.fullmatch(name) else ascii(name[:200])


def _wheel_problem(archive: zipfile.ZipFile, dist_info: str) -> str | None:
    infos = archive.infolist()
    if len(infos) > WHEEL_MAX_FILES:
        return f"{len(infos)} files (at most {WHEEL_MAX_FILES})"
    if sum(info.file_size for info in infos) > WHEEL_MAX_BYTES:
        return f"unpacks to more than {WHEEL_MAX_BYTES >> 20} MiB"
    names = [info.filename for info in infos]
    if len(set(names)) != len(names):
        return "a file is in it twice"
    for info in infos:
        name, mode = info.filename, info.external_attr >> 16
        said = shown(name)
        parts = name.rstrip("/").split("/")
        if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
            return f"{said}: not a plain relative path"
        if stat.S_ISLNK(mode) or mode & 0o7000:
            return f"{said}: a link or setuid/setgid/sticky bits (mode {mode:o})"
        if name.endswith(".pth"):
            return f"{said}: a .pth file (Python runs it at every start)"
        if name == f"{dist_info}entry_points.txt":
            return f"{said}: entry points (scripts in the venv's bin, on the units' PATH)"
        if not (name.startswith(("exllamav3/", dist_info)) or EXTENSION.fullmatch(name)):
            return f"{said}: outside the exllamav3 package, its extension and {dist_info}"
    record_name = f"{dist_info}RECORD"
    if record_name not in names:
        return f"no {record_name}"
    record: dict[str, str] = {}
    for row in csv.reader(io.StringIO(archive.read(record_name).decode("utf-8"))):
        if row and row[0] != record_name:
            if len(row) < 2 or not row[1].startswith("sha256="):
                return f"RECORD has no sha256 for {shown(row[0])}"
            record[row[0]] = row[1].removeprefix("sha256=")
    files = [n for n in names if not n.endswith("/") and n != record_name]
    if sorted(files) != sorted(record):
        extra = sorted(set(files) ^ set(record))[:3]
        return f"RECORD does not list exactly its files ({', '.join(map(shown, extra))})"
    for name in files:
        digest = hashlib.sha256()
        with archive.open(name) as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        found = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        if found != record[name]:
            return f"{shown(name)} does not match its RECORD hash"
    return None


def check_wheel(path: Path, version: str, name: str | None = None) -> None:
    """Refuse (WheelCacheError, one line naming the file) a wheel that holds more than exllamav3
    `version` (its package, its compiled extension, its .dist-info without entry points): no
    .pth, no other module, no scripts or data, no links; each file as RECORD hashes it; bounded
    in size. Only what pip would lay out is read, nothing is run."""
    try:
        with zipfile.ZipFile(path) as archive:
            problem = _wheel_problem(archive, f"exllamav3-{version}.dist-info/")
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        problem = f"not a readable wheel ({shown(str(exc))})"
    if problem:
        raise WheelCacheError(f"{name or path.name}: {problem}: refused")


@dataclass(frozen=True)
class WheelCheck:
    """check_wheel for one exllamav3 version, as the cache's `check` (a plain repr: the
    operation cases show it)."""

    version: str

    def __call__(self, path: Path, name: str | None = None) -> None:
        check_wheel(path, self.version, name)


def download_names(wheel: str, box: str) -> tuple[str, str]:
    """This box's temporary names, in the entry's directory, for the wheel and its sidecar it
    copies back: one pair per box (`box`: the inventory's host name, hashed into the name), so
    boxes of one stack copying back in the same run never write or move each other's files."""
    tag = hashlib.sha256(box.encode()).hexdigest()[:12]
    return f".{wheel}.{tag}.download", f".{wheel}.{tag}.sha256.download"


def commit_download(entry_dir: str, wheel: str, key: str, box: str,
                    builders: Collection[str], check: Callable[[Path, str], None]) -> bool:
    """Move `box`'s downloaded wheel and sidecar into the cache if `box` is a cache builder
    (one of `builders`), they match and `check` (the content's, raising WheelCacheError)
    passes; True when they became the entry, False when a builder's entry was already there
    (the first whole copy wins: builders of one stack that built in the same run made equally
    good wheels, each installed on its own box). An entry from a box that is not a builder now
    is replaced. The wheel is renamed into place first and the sidecar last, under a lock, so
    readers see a whole entry or none. This box's downloads are removed either way. Raises
    WheelCacheError (or OSError) when the download is refused."""
    entry = Path(entry_dir)
    names = download_names(wheel, box)
    tmp_wheel, tmp_sidecar = entry / names[0], entry / names[1]
    try:
        if box not in builders:
            raise WheelCacheError(f"{box} is not a cache builder (cache_builder: true): what "
                                  "it built stays on it")
        want = sidecar_sha256(tmp_sidecar, wheel)
        found = file_sha256(tmp_wheel)
        if found != want:
            raise WheelCacheError(f"downloaded {wheel} has sha256 {found}, the box's sidecar "
                                  f"says {want}")
        check(tmp_wheel, f"{wheel} copied back")
        with (entry.parent / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if trusted_entry(entry, wheel, builders) and cached_wheel(entry, wheel):
                    return False
            except WheelCacheError:
                pass  # a corrupt entry is replaced by this verified one
            # An entry being replaced is incomplete (no sidecar) until the new one is whole.
            (entry / f"{wheel}.sha256").unlink(missing_ok=True)
            (entry / "stack.txt").write_text(key + "\n")
            (entry / f".{BUILT_BY}.tmp").write_text(box + "\n")
            os.replace(entry / f".{BUILT_BY}.tmp", entry / BUILT_BY)
            os.replace(tmp_wheel, entry / wheel)
            os.replace(tmp_sidecar, entry / f"{wheel}.sha256")
            return True
    finally:
        for leftover in (tmp_wheel, tmp_sidecar):
            leftover.unlink(missing_ok=True)


# The two steps below run on the operator's machine inside the deploy (pyinfra FunctionCommands,
# given pyinfra's State and the Host). A failure is this host's alone: one line in the run log
# and False, which pyinfra takes as the operation failing on this host (an exception would be
# printed with its traceback).

def _refuse(host: object, message: str) -> bool:
    from pyinfra import logger
    host.log_styled(f"cache on the operator's machine: {message}", fg="red",
                    log_func=logger.error)
    return False


def prepare_entry(state: object, host: object, entry_dir: str) -> bool:
    """FunctionCommand: make the entry's directory (downloads land in it under this box's
    temporary names)."""
    try:
        Path(entry_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _refuse(host, f"cannot create {entry_dir}: {exc.strerror}")
    return True


def commit_entry(state: object, host: object, entry_dir: str, wheel: str, key: str,
                 builders: Collection[str], check: Callable[[Path, str], None]) -> bool:
    """FunctionCommand: this box's downloaded wheel (or archive: `check` says what it may hold)
    into the cache (commit_download)."""
    try:
        commit_download(entry_dir, wheel, key, host.name, builders, check)
    except WheelCacheError as exc:
        return _refuse(host, f"{exc}: not cached")
    except OSError as exc:
        return _refuse(host, f"{exc.filename or entry_dir}: {exc.strerror}: not cached")
    return True
