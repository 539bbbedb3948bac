"""The engine's kernels shipped between boxes of a stack (donorkit/box/kernel_cache.py), run for
real: the operations' own commands executed in a real shell (tar, sha256sum, chown) on two "boxes"
made of temporary folders, the copy back and the upload done as pyinfra does them (a file
copy), the box's fact read with its own command. What the real FlashInfer does with the
shipped kernels was measured on the GPU machine (docs/gpu.md,
gpu/results/h200-engine-2026-12-01-evening)."""

from __future__ import annotations

import getpass
import os
import pwd
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
from pyinfra.api import FileDownloadCommand, FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.context import ctx_host

from donorkit.box import kernel_cache, wheel_cache
from donorkit.box.kernel_cache import EngineKernels, UnitKernels, keep_kernels, ship_kernels
from donorkit.box.wheel_cache import WheelCacheError
from pyinfra_declared.json_cases import CaseHost
from tests.support.wheels import make_tar

VENV = {"vllm": "0.26.0", "torch": "2.11.0", "flashinfer-python": "0.6.14"}
CUDA = {"nvcc": "13.3", "torch_cuda": "13.0"}
KERNEL = ".cache/flashinfer/0.6.14/89/cached_ops/batch_prefill_f16/batch_prefill_f16.so"


class Box:
    """A box as folders: the service user's home, the venv (with FlashInfer's package), state."""

    def __init__(self, root: Path, name: str, cache: Path, unit_text: str = "",
                 builders: tuple[str, ...] = ("box-a",), service_user: str = ""):
        self.name, self.root = name, root / name
        self.home = self.root / "home/fox"
        self.site = self.root / "venv/lib/python3.12/site-packages"
        (self.site / "flashinfer/data").mkdir(parents=True)
        self.home.mkdir(parents=True)
        self.kernels = UnitKernels(
            unit="vllm-qwen.service",
            # Rendered units name their box in the header comment (donorkit/render/templates.py).
            unit_text=unit_text or f"# Managed by the uncloseai donor deploy ({name}).\n"
                                   "[Service]\nEnvironment=MAX_JOBS=2\n",
            checkpoint="org/qwen",
            revision="4ff9003a3365", arch="8.9", distro="ubuntu24.04",
            venv_dir=str(self.root / "venv"), cuda_home="/usr/local/cuda-13.3",
            home=str(self.home), service_user=service_user or getpass.getuser(),
            stamp=str(self.root / "state/vllm-qwen.service.kernels"),
            box_dir=str(self.root / "kernels"), cache_dir=str(cache), builders=builders)

    def fact(self) -> dict:
        command = EngineKernels().command(stamp=self.kernels.stamp, home=self.kernels.home)
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
        return EngineKernels().process(out.stdout.splitlines())

    def run(self, operation) -> list[str]:
        """The operation's commands for this box's facts, executed; returns the noop lines."""
        host = CaseHost()
        host.name = self.name
        errors: list[str] = []  # what a failing cache step says (pyinfra's log, for the run)
        host.log_styled = lambda message, **_: errors.append(message)
        with ctx_host.use(host):
            commands = list(operation.plan(kernels=self.kernels, box=self.fact(), venv=VENV,
                                           cuda=CUDA))
        for command in commands:
            if isinstance(command, (FileUploadCommand, FileDownloadCommand)):
                shutil.copyfile(command.src, command.dest)
            elif isinstance(command, FunctionCommand):
                # False: this host's step failed (pyinfra stops the host there).
                if not command.function(None, host, *command.args, **command.kwargs):
                    raise RuntimeError(f"{command.function.__name__} failed: {errors}")
            else:
                text = command.get_raw_value() if isinstance(command, StringCommand) \
                    else str(command)
                done = subprocess.run(["sh", "-c", text], capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(done.stderr)
        return host.noops


def engine_first_start(box: Box) -> None:
    """What vLLM's first start leaves in the service user's home (stand-in files)."""
    for path in (KERNEL, ".cache/vllm/torch_compile_cache/ab12/rank_0_0/model",
                 ".triton/cache/XYZ/kernel.cubin", ".nv/ComputeCache/index"):
        (box.home / path).parent.mkdir(parents=True, exist_ok=True)
        (box.home / path).write_bytes(path.encode())


def entries_of(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if not p.name.startswith(".")]  # not the lock file


@pytest.fixture
def boxes(tmp_path: Path) -> tuple[Box, Box, Path]:
    cache = tmp_path / "operator-cache"
    return Box(tmp_path, "box-a", cache), Box(tmp_path, "box-b", cache), cache


def test_the_first_box_builds_and_keeps_a_later_box_starts_with_them(boxes) -> None:
    first, second, cache = boxes
    # The first box: nothing cached, so its engine builds; the stamp says the stack is settled.
    assert first.run(ship_kernels) == []
    assert first.fact()["stamp"]
    assert first.run(keep_kernels) == [f"{first.kernels.unit} has built no FlashInfer kernels: "
                                       "nothing to keep"]
    engine_first_start(first)
    first.run(keep_kernels)
    entries = entries_of(cache)
    assert len(entries) == 1 and sorted(p.name for p in entries[0].iterdir()) == \
        ["built-by", "kernels.tar", "kernels.tar.sha256", "stack.txt"]
    assert (entries[0] / "built-by").read_text() == "box-a\n"  # written here, not by the box
    assert not Path(first.kernels.box_dir, entries[0].name).exists()  # the box's archive gone

    # The second box gets them before its unit starts: FlashInfer's kernel in the venv's folder
    # of precompiled kernels (NAME/NAME.so), the rest in the home, owned by the service user.
    second.run(ship_kernels)
    aot = second.site / "flashinfer/data/aot/batch_prefill_f16/batch_prefill_f16.so"
    assert aot.read_bytes() == KERNEL.encode()
    assert not (second.home / ".cache/flashinfer").exists()
    for path in (".cache/vllm/torch_compile_cache/ab12/rank_0_0/model",
                 ".triton/cache/XYZ/kernel.cubin", ".nv/ComputeCache/index"):
        assert (second.home / path).read_bytes() == path.encode()
        assert (second.home / path).owner() == getpass.getuser()
    assert not list(Path(second.kernels.box_dir).glob("*"))  # the upload removed

    # Converged: both steps are noops on both boxes.
    for box in (first, second):
        assert box.run(ship_kernels) and box.run(keep_kernels)


def test_another_unit_is_another_stack(boxes, tmp_path: Path) -> None:
    first, _, cache = boxes
    first.run(ship_kernels)
    engine_first_start(first)
    first.run(keep_kernels)
    other = Box(tmp_path, "box-c", cache, unit_text="[Service]\nEnvironment=MAX_JOBS=4\n")
    other.run(ship_kernels)
    assert not (other.site / "flashinfer/data/aot").exists()  # nothing of that stack cached
    assert kernel_cache.stack_key(other.kernels, VENV, "13.3", "x86_64") != \
        kernel_cache.stack_key(first.kernels, VENV, "13.3", "x86_64")


def test_what_only_a_build_needed_does_not_split_a_stack(boxes) -> None:
    """The first box of a stack builds exllamav3 (its venv gets what that build needed); later
    boxes install its wheel: their venvs differ there, their kernels do not (the testbed's
    tb-4090b once found no kernels of tb-4090's stack for that)."""
    first, second, _ = boxes
    built_here = {**VENV, "setuptools": "80.9.0", "wheel": "0.48.0"}
    assert kernel_cache.stack_key(first.kernels, built_here, "13.3", "x86_64") == \
        kernel_cache.stack_key(second.kernels, VENV, "13.3", "x86_64")
    assert kernel_cache.stack_key(first.kernels, {**VENV, "torch": "2.12.0"}, "13.3",
                                  "x86_64") != \
        kernel_cache.stack_key(first.kernels, VENV, "13.3", "x86_64")


def test_an_upload_that_does_not_match_the_cache_is_not_used(boxes) -> None:
    first, second, cache = boxes
    first.run(ship_kernels)
    engine_first_start(first)
    first.run(keep_kernels)
    archive = entries_of(cache)[0] / "kernels.tar"
    sidecar = archive.with_name("kernels.tar.sha256")
    sidecar.write_text("0" * 64 + "  kernels.tar\n")
    with pytest.raises(Exception, match="is corrupt"):
        second.run(ship_kernels)
    assert not (second.site / "flashinfer/data/aot").exists()
    assert not Path(second.kernels.stamp).exists()


# Issue 32: kernels are code every engine of the stack loads, unpacked as root. Only a cache
# builder's are kept and shipped; an archive holds the engine's caches and nothing else (checked
# on the operator's machine before it is stored and before it is shipped); on the box the home's
# part is unpacked by the service user and nothing keeps the archive's owners or modes.

SO = ".cache/flashinfer/0.6.14/89/cached_ops/k/k.so"
HOSTILE_ARCHIVES = {
    # name: (members, the refusal)
    "a setuid file": ([(SO, "file", 0o4755, b"so")], "k.so: setuid/setgid/sticky bits (mode 4755)"),
    "a setgid folder": ([(".cache/vllm", "dir", 0o2755, b"")], "setuid/setgid/sticky"),
    "a link out of the home": ([(".triton", "symlink", 0o777, "/var"),
                                (".triton/cache/x", "file", 0o644, b"x")],
                               ".triton: a link (only files and folders)"),
    "a link inside a cache": ([(".cache/vllm/x", "symlink", 0o777, "/etc/shadow")], "a link"),
    "a hard link": ([(".cache/vllm/x", "hardlink", 0o644, "/etc/shadow")], "a link"),
    "a fifo": ([(".cache/vllm/x", "fifo", 0o644, b"")], "a device or fifo"),
    "a ../ path": ([(".cache/vllm/../../../../etc/cron.d/x", "file", 0o644, b"x")],
                   "not a plain relative path"),
    "an absolute path": ([("/etc/cron.d/x", "file", 0o644, b"x")], "not a plain relative path"),
    "ssh keys": ([(".ssh/authorized_keys", "file", 0o600, b"ssh-ed25519 AAAA volunteer")],
                 ".ssh/authorized_keys: outside the engine's caches"),
    "a name that retitles the terminal": (
        [(".cache/vllm/\x1b]0;owned\x07", "file", 0o644, b"x"), ("\x1b[2J", "file", 0o644, b"")],
        "'\\x1b[2J': outside the engine's caches"),
    "a FlashInfer path that is no kernel": (
        [(".cache/flashinfer/0.6.14/89/cached_ops/k/other.py", "file", 0o644, b"x")],
        "outside the engine's caches"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ARCHIVES))
def test_a_hostile_archive_is_refused_before_it_is_stored(case: str, tmp_path: Path) -> None:
    """What a box sends back as its kernels (it is root there: anything), refused on the
    operator's machine in one line naming the file, nothing stored."""
    members, refusal = HOSTILE_ARCHIVES[case]
    archive = make_tar(tmp_path / "kernels.tar", [(SO, "file", 0o755, b"so"), *members])
    with pytest.raises(WheelCacheError, match=re.escape(refusal)):
        kernel_cache.check_archive(archive)
    entry = tmp_path / "cache/id"
    entry.mkdir(parents=True)
    tmp_archive, tmp_sidecar = wheel_cache.download_names("kernels.tar", "box-a")
    shutil.copyfile(archive, entry / tmp_archive)
    (entry / tmp_sidecar).write_text(f"{wheel_cache.file_sha256(archive)}  kernels.tar\n")
    host, errors = CaseHost(), []
    host.log_styled = lambda message, **_: errors.append(message)  # pyinfra's log line
    assert wheel_cache.commit_entry(None, host, str(entry), "kernels.tar", "k", ("box-a",),
                                    kernel_cache.ArchiveCheck()) is False
    assert len(errors) == 1 and "\n" not in errors[0] and refusal in errors[0], errors
    assert errors[0].startswith("cache on the operator's machine: kernels.tar copied back: ")
    assert list(entry.iterdir()) == []


def test_a_good_archive_passes() -> None:
    """What a first start leaves (made by the real tar, as keep_kernels makes it) passes."""
    # test_the_first_box_builds_and_keeps_a_later_box_starts_with_them stores and ships one;
    # here the members one by one, as the check sees them.
    for name, kind, mode in ((SO, "file", 0o755), (".cache/vllm", "dir", 0o700),
                             (".triton/cache/a/b.cubin", "file", 0o644),
                             (".nv/ComputeCache/0/1", "file", 0o600)):
        info = tarfile.TarInfo(name)
        info.type = tarfile.DIRTYPE if kind == "dir" else tarfile.REGTYPE
        info.mode = mode
        assert kernel_cache.member_problem(info) is None, name


def test_a_box_whose_home_holds_a_link_keeps_nothing(boxes) -> None:
    """A builder's engine home with a link in a cache (the service user made it, or the box's
    owner): the real tar archives the link, the operator's machine refuses the archive."""
    first, _, cache = boxes
    first.run(ship_kernels)
    engine_first_start(first)
    (first.home / ".cache/vllm/escape").symlink_to("/etc")
    with pytest.raises(RuntimeError, match=re.escape(
            "commit_entry failed: [\"cache on the operator's machine: kernels.tar copied back: "
            ".cache/vllm/escape: a link (only files and folders): refused: not cached\"]")):
        first.run(keep_kernels)
    assert [p for p in entries_of(cache) if list(p.iterdir())] == []


def test_kernels_of_a_box_that_is_not_a_builder_are_neither_kept_nor_shipped(
        tmp_path: Path) -> None:
    cache = tmp_path / "operator-cache"
    volunteer = Box(tmp_path, "box-v", cache)  # builders: box-a only
    volunteer.run(ship_kernels)
    engine_first_start(volunteer)
    assert volunteer.run(keep_kernels) == [
        "box-v is not a cache builder (cache_builder): what the engine of vllm-qwen.service "
        "built stays on it"]
    assert not cache.exists() or entries_of(cache) == []

    # An entry a non-builder left (a run before cache builders; or a builder no longer trusted):
    # not shipped, the next box builds its own; a builder's copy then replaces it.
    former = Box(tmp_path, "box-f", cache, builders=("box-f",))
    former.run(ship_kernels)
    engine_first_start(former)
    former.run(keep_kernels)
    [entry] = entries_of(cache)
    second = Box(tmp_path, "box-b", cache)  # box-f is no builder for this run
    assert second.run(ship_kernels) == [
        f"the cached kernels of stack {entry.name} was built by 'box-f', which is not a cache "
        "builder (cache_builder: true): not shipped, the engine of vllm-qwen.service builds "
        "its own"]
    assert not (second.site / "flashinfer/data/aot").exists()
    assert not (second.home / ".cache/vllm").exists()
    assert second.fact()["stamp"]  # settled: its engine builds its own on its first start
    (entry / "built-by").unlink()  # as an older run left it
    assert "no record of the box that built it" in Box(tmp_path, "box-c", cache).run(
        ship_kernels)[0]
    builder = Box(tmp_path, "box-a", cache)
    builder.run(ship_kernels)
    engine_first_start(builder)
    builder.run(keep_kernels)
    assert (entry / "built-by").read_text() == "box-a\n"


def test_a_hostile_archive_in_the_cache_is_not_shipped(boxes) -> None:
    """An entry recorded as a builder's whose archive is hostile (the cache folder edited, or an
    entry an older version stored): refused before anything is uploaded."""
    first, second, cache = boxes
    first.run(ship_kernels)
    engine_first_start(first)
    first.run(keep_kernels)
    [entry] = entries_of(cache)
    archive = make_tar(entry / "kernels.tar", [(".ssh/authorized_keys", "file", 0o600, b"k")])
    (entry / "kernels.tar.sha256").write_text(
        f"{wheel_cache.file_sha256(archive)}  kernels.tar\n")
    with pytest.raises(RuntimeError, match="authorized_keys: outside the engine's caches"):
        second.run(ship_kernels)
    assert not Path(second.kernels.box_dir).exists()


@pytest.fixture
def nobody_boxes():
    """Boxes whose service user is `nobody` (this machine's), in a folder it can reach: the
    deploy's tar runs as that user for real."""
    root = Path(tempfile.mkdtemp(prefix="kernel-boxes-"))
    root.chmod(0o755)
    cache = root / "operator-cache"
    made = [Box(root, name, cache, service_user="nobody") for name in ("box-a", "box-b")]
    for box in made:
        for folder in (box.root, box.root / "home"):
            folder.chmod(0o755)
        os.chown(box.home, pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("nobody").pw_gid)
    yield made
    shutil.rmtree(root)


def test_the_box_unpacks_as_the_service_user_without_modes(nobody_boxes, monkeypatch) -> None:
    """Even an archive that got past the check (the check off here) cannot give the box a
    setuid file, and the home's part lands as the service user's own: a link the user planted
    in its home (`.triton -> a root folder`) leads the unpacking nowhere it could not write."""
    first, second = nobody_boxes
    first.run(ship_kernels)
    engine_first_start(first)
    for path in first.home.rglob("*"):
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1, follow_symlinks=False)
    first.run(keep_kernels)
    [entry] = entries_of(Path(first.kernels.cache_dir))
    archive = make_tar(entry / "kernels.tar", [
        (SO, "file", 0o4755, b"setuid kernel"),
        (".cache/vllm/setuid", "file", 0o6755, b"setuid"),
        (".triton/cache/XYZ/kernel.cubin", "file", 0o644, b"cubin")])
    (entry / "kernels.tar.sha256").write_text(
        f"{wheel_cache.file_sha256(archive)}  kernels.tar\n")
    monkeypatch.setattr(kernel_cache, "check_archive", lambda path: None)
    root_folder = Path(second.root, "root-owned")
    root_folder.mkdir(mode=0o755)
    (second.home / ".triton").symlink_to(root_folder)  # the service user's link
    with pytest.raises(RuntimeError, match="Permission denied"):
        second.run(ship_kernels)
    assert list(root_folder.iterdir()) == []  # nothing written through the link
    (second.home / ".triton").unlink()
    second.run(ship_kernels)
    aot = second.site / "flashinfer/data/aot/k/k.so"
    assert aot.read_bytes() == b"setuid kernel" and not aot.stat().st_mode & 0o7000
    assert aot.stat().st_uid == 0 and aot.stat().st_mode & 0o777 == 0o755  # as the venv's files
    for path in (".cache/vllm/setuid", ".triton/cache/XYZ/kernel.cubin"):
        made = second.home / path
        assert not made.stat().st_mode & 0o7000, oct(made.stat().st_mode)
        assert made.owner() == "nobody" and made.parent.owner() == "nobody"
