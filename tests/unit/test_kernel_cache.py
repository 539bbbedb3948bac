"""The engine's kernels shipped between boxes of a stack (donorkit/kernel_cache.py), run for real:
the operations' own commands executed in a real shell (tar, sha256sum, chown) on two "boxes"
made of temporary folders, the copy back and the upload done as pyinfra does them (a file
copy), the box's fact read with its own command. What the real FlashInfer does with the
shipped kernels was measured on the GPU machine (docs/gpu.md,
gpu/results/h200-engine-2026-12-01-evening)."""

from __future__ import annotations

import getpass
import shutil
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FileDownloadCommand, FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.context import ctx_host

from donorkit import kernel_cache
from donorkit.kernel_cache import EngineKernels, UnitKernels, keep_kernels, ship_kernels
from pyinfra_declared.json_cases import CaseHost

VENV = {"vllm": "0.26.0", "torch": "2.11.0", "flashinfer-python": "0.6.14"}
CUDA = {"nvcc": "13.3", "torch_cuda": "13.0"}
KERNEL = ".cache/flashinfer/0.6.14/89/cached_ops/batch_prefill_f16/batch_prefill_f16.so"


class Box:
    """A box as folders: the service user's home, the venv (with FlashInfer's package), state."""

    def __init__(self, root: Path, name: str, cache: Path, unit_text: str = ""):
        self.name, self.root = name, root / name
        self.home = self.root / "home/fox"
        self.site = self.root / "venv/lib/python3.12/site-packages"
        (self.site / "flashinfer/data").mkdir(parents=True)
        self.home.mkdir(parents=True)
        self.kernels = UnitKernels(
            unit="vllm-qwen.service",
            # Rendered units name their box in the header comment (donorkit/render.py).
            unit_text=unit_text or f"# Managed by the uncloseai donor deploy ({name}).\n"
                                   "[Service]\nEnvironment=MAX_JOBS=2\n",
            checkpoint="org/qwen",
            revision="4ff9003a3365", arch="8.9", distro="ubuntu24.04",
            venv_dir=str(self.root / "venv"), cuda_home="/usr/local/cuda-13.3",
            home=str(self.home), service_user=getpass.getuser(),
            stamp=str(self.root / "state/vllm-qwen.service.kernels"),
            box_dir=str(self.root / "kernels"), cache_dir=str(cache))

    def fact(self) -> dict:
        command = EngineKernels().command(stamp=self.kernels.stamp, home=self.kernels.home)
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
        return EngineKernels().process(out.stdout.splitlines())

    def run(self, operation) -> list[str]:
        """The operation's commands for this box's facts, executed; returns the noop lines."""
        host = CaseHost()
        host.name = self.name
        with ctx_host.use(host):
            commands = list(operation.plan(kernels=self.kernels, box=self.fact(), venv=VENV,
                                           cuda=CUDA))
        for command in commands:
            if isinstance(command, (FileUploadCommand, FileDownloadCommand)):
                shutil.copyfile(command.src, command.dest)
            elif isinstance(command, FunctionCommand):
                assert command.function(None, host, *command.args, **command.kwargs)
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
        ["kernels.tar", "kernels.tar.sha256", "stack.txt"]
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
