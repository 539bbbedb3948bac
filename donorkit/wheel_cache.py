"""The exllamav3 wheel cache: one wheel per card stack, built by the first box of that stack and
kept on the operator's machine for every later box.

A stack is everything that decides the compiled wheel: exllamav3's version, git ref and the patches
applied to it (inventory data), and from the box (facts, read when the operation runs): the
venv's Python ABI, torch's version with its CUDA variant, nvcc's release, the card's arch
(data), the distro (glibc/libstdc++ the wheel links against) and the CPU architecture.

Cache layout (on the operator's machine, under the git-ignored `exllamav3_wheel_cache`):

    <cache>/exllamav3/<stack id>/exllamav3-1.5.1-cp312-cp312-linux_x86_64.whl
    <cache>/exllamav3/<stack id>/exllamav3-1.5.1-cp312-cp312-linux_x86_64.whl.sha256
    <cache>/exllamav3/<stack id>/stack.txt          (the stack key, for people)

The sidecar is `sha256sum` output; it is checked before an upload (here) and after it (on the
box, before pip sees the file). Entries are only ever created by rename, sidecar last, under a
lock: a partial or corrupt download never becomes an entry. Each box downloads under its own
temporary names (download_names): boxes of one stack copying back in one run do not collide,
and the first whole copy becomes the entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
from pathlib import Path

from pyinfra.api import FactBase, FileDownloadCommand

from donorkit.paths import repo_path
from donorkit.transport import AnswerTooLarge
from pyinfra_declared.batched_facts import first, sections


class WheelCacheError(Exception):
    """A cached wheel that must not be used; the message names the file."""


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


# The most a copy-back may be, in bytes: a sidecar (one sha256sum line), an exllamav3 wheel (tens
# of MB for one arch), a stack's kernel archive (FlashInfer's kernels and the compile caches).
SIDECAR_MAX_BYTES, WHEEL_DOWNLOAD_MAX_BYTES, KERNELS_DOWNLOAD_MAX_BYTES = 4096, 2 << 30, 16 << 30


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
    fields = sidecar.read_text().split()
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


def download_names(wheel: str, box: str) -> tuple[str, str]:
    """This box's temporary names, in the entry's directory, for the wheel and its sidecar it
    copies back: one pair per box (`box`: the inventory's host name, hashed into the name), so
    boxes of one stack copying back in the same run never write or move each other's files."""
    tag = hashlib.sha256(box.encode()).hexdigest()[:12]
    return f".{wheel}.{tag}.download", f".{wheel}.{tag}.sha256.download"


def commit_download(entry_dir: str, wheel: str, key: str, box: str) -> bool:
    """Move `box`'s downloaded wheel and sidecar into the cache if they match; True when they
    became the entry, False when an entry was already there (the first whole copy wins: boxes
    of one stack that built in the same run made equally good wheels, each installed on its
    own box). The wheel is renamed into place first and the sidecar last, under a lock, so
    readers see a whole entry or none. This box's downloads are removed either way. Raises
    WheelCacheError (or OSError) when the download does not match its sidecar."""
    entry = Path(entry_dir)
    names = download_names(wheel, box)
    tmp_wheel, tmp_sidecar = entry / names[0], entry / names[1]
    try:
        want = sidecar_sha256(tmp_sidecar, wheel)
        found = file_sha256(tmp_wheel)
        if found != want:
            raise WheelCacheError(f"downloaded {wheel} has sha256 {found}, the box's sidecar "
                                  f"says {want}")
        with (entry.parent / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if cached_wheel(entry, wheel):
                    return False
            except WheelCacheError:
                pass  # a corrupt entry is replaced by this verified one
            (entry / "stack.txt").write_text(key + "\n")
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


def commit_entry(state: object, host: object, entry_dir: str, wheel: str, key: str) -> bool:
    """FunctionCommand: this box's downloaded wheel into the cache (commit_download)."""
    try:
        commit_download(entry_dir, wheel, key, host.name)
    except WheelCacheError as exc:
        return _refuse(host, f"{exc}: not cached")
    except OSError as exc:
        return _refuse(host, f"{exc.filename or entry_dir}: {exc.strerror}: not cached")
    return True
