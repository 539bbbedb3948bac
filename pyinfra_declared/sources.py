"""Source trees on a host: a git checkout at a ref, or a directory shipped from the operator's
machine, stamped with its digest."""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from pathlib import Path

from pyinfra import host
from pyinfra.api import FileUploadCommand

from pyinfra_declared.batched_facts import (
    GitCheckout,
    PathStates,
)
from pyinfra_declared.decorator import operation
from pyinfra_declared.snapshot import need

q = shlex.quote


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
