"""Wheels and tar archives made here for the cache tests: real zip files with a RECORD as pip
and the wheel package write it, real tar archives (tarfile), hostile ones included."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

VERSION = "1.5.1"
DIST_INFO = f"exllamav3-{VERSION}.dist-info"
EXT = "exllamav3_ext.cpython-312-x86_64-linux-gnu.so"


def good_files() -> dict[str, bytes]:
    """What an exllamav3 wheel holds: the package, its extension, its .dist-info."""
    return {"exllamav3/__init__.py": b"__version__ = '1.5.1'\n",
            "exllamav3/model/__init__.py": b"",
            EXT: b"\x7fELF stand-in extension",
            f"{DIST_INFO}/METADATA": b"Metadata-Version: 2.1\nName: exllamav3\nVersion: 1.5.1\n",
            f"{DIST_INFO}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                  b"Tag: cp312-cp312-linux_x86_64\n",
            f"{DIST_INFO}/top_level.txt": b"exllamav3\nexllamav3_ext\n"}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def make_wheel(path: Path, files: dict[str, bytes], record: dict[str, bytes] | None = None,
               modes: dict[str, int] | None = None) -> Path:
    """A wheel of `files` whose RECORD hashes `record` (default: the files themselves)."""
    listed = files if record is None else record
    lines = [f"{name},{record_hash(data)},{len(data)}" for name, data in listed.items()]
    lines.append(f"{DIST_INFO}/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in {**files, f"{DIST_INFO}/RECORD": "\n".join(lines).encode()}.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (modes or {}).get(name, 0o100644) << 16
            archive.writestr(info, data)
    return path


def make_tar(path: Path, members: list[tuple[str, str, int, bytes | str]]) -> Path:
    """A tar of (name, kind, mode, data or link target) members; kind: file, dir, symlink,
    hardlink, fifo."""
    kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
             "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        for name, kind, mode, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = kinds[kind], mode, 4242, 4242
            if kind in ("symlink", "hardlink"):
                info.linkname = str(data)
                archive.addfile(info)
            elif kind == "file":
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            else:
                archive.addfile(info)
    return path
