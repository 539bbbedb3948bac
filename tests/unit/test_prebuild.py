"""FlashInfer's kernels built before a unit's first start (files/prebuild_kernels.py, run by
donorkit/box/prebuild.py's operation): the script's own reading of the model and of the box's
memory, and the operation's command run for real in a shell as the service user, once per stack.
What the build itself does with the real FlashInfer was measured on the GPU machine (docs/gpu.md,
gpu/results/h200-engine-2026-12-03-qwen35: four modules in 115 s, the engine then
built none)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.context import ctx_host

from donorkit.box.kernel_cache import EngineKernels
from donorkit.box.prebuild import (
    checkpoint_config,
    prebuild_command,
    prebuild_kernels,
    prebuild_stamp,
)
from donorkit.inventory.paths import REPO_ROOT
from pyinfra_declared.json_cases import CaseHost
from tests.unit.test_kernel_cache import CUDA, VENV, Box

SCRIPT = REPO_ROOT / "files/prebuild_kernels.py"
spec = importlib.util.spec_from_file_location("prebuild_kernels", SCRIPT)
prebuild_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prebuild_script)


def test_the_model_shape_is_read_from_its_config() -> None:
    qwen35 = {"architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"head_dim": 256, "torch_dtype": "float16"}}
    llama = {"hidden_size": 4096, "num_attention_heads": 32, "torch_dtype": "bfloat16"}
    assert prebuild_script.head_dim(qwen35) == 256  # the text model's, not the vision tower's
    assert prebuild_script.head_dim(llama) == 128
    assert prebuild_script.model_dtype(llama, "auto") == "bfloat16"
    assert prebuild_script.model_dtype(qwen35, "float16") == "float16"


@pytest.mark.parametrize("available_kib, jobs", [(8 * 2**20, 1),
                                                 (24 * 2**20, min(5, os.cpu_count())),
                                                 (1024 * 2**20, os.cpu_count())])
def test_compile_jobs_are_sized_from_the_box_memory(tmp_path: Path, available_kib: int,
                                                    jobs: int) -> None:
    """(MemAvailable - reserve) / GiB a job, at least one, at most the CPU count."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {2 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    assert prebuild_script.jobs(4, 4, str(meminfo)) == jobs


def test_an_unreadable_config_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--config", str(tmp_path / "none.json"),
                             "--dtype", "float16", "--arch", "8.9", "--gib-per-job", "4"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"prebuild_kernels: {tmp_path / 'none.json'}: cannot read")


def run_operation(box: Box, command: str) -> list[str]:
    """The operation's commands for the box's fact (read at the prebuild's own stamp), run."""

    host = CaseHost()
    host.name = box.name
    read = EngineKernels().command(stamp=prebuild_stamp(box.kernels), home=box.kernels.home)
    out = subprocess.run(["sh", "-c", read], capture_output=True, text=True, check=True)
    with ctx_host.use(host):
        commands = list(prebuild_kernels.plan(kernels=box.kernels, command=command,
                                              box=EngineKernels().process(out.stdout.splitlines()),
                                              venv=VENV, cuda=CUDA))
    for item in commands:
        if isinstance(item, FunctionCommand):  # the streamed build: run as the box would
            text = item.args[0]
        else:
            text = item.get_raw_value() if isinstance(item, StringCommand) else str(item)
        done = subprocess.run(["sh", "-c", text], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return host.noops


@pytest.mark.skipif(os.geteuid() != 0, reason="runuser needs root")
def test_the_build_runs_as_the_service_user_with_the_units_environment_once(
        tmp_path: Path) -> None:
    """The command as the deploy gives it, run for real: runuser, `env -i` with exactly the
    unit's environment and HOME, the venv's python on the script (a TEST DOUBLE of the script
    that records what it was given: FlashInfer cannot build here), the checkpoint's config where
    the weights step leaves it; then the stamp makes a second run a noop."""
    box = Box(tmp_path, "box-a", tmp_path / "cache")
    (Path(box.kernels.venv_dir) / "bin").mkdir(parents=True)
    (Path(box.kernels.venv_dir) / "bin/python").symlink_to(sys.executable)
    record = tmp_path / "record.json"
    double = tmp_path / "prebuild_kernels.py"
    double.write_text("import json, os, sys\n"
                      f"open({str(record)!r}, 'w').write(json.dumps("
                      "{'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    environment = {"CUDA_HOME": "/usr/local/cuda-13.3", "MAX_JOBS": "2",
                   "PATH": "/opt/uncloseai/vllm-venv/bin:/usr/bin:/bin"}
    args = ["--max-num-seqs", "12", "--kv-cache-dtype", "fp8", "--dtype", "float16"]
    command = prebuild_command(box.kernels, str(double), environment, args, 4, 4)
    assert run_operation(box, command) == []
    seen = json.loads(record.read_text())
    seen["env"].pop("LC_CTYPE", None)  # Python's own locale coercion (PEP 538), not the shell's
    assert seen["env"] == {**environment, "HOME": box.kernels.home}  # nothing else of root's
    assert seen["argv"] == ["--config", checkpoint_config(box.kernels), "--dtype", "float16",
                            "--kv-cache-dtype", "fp8", "--arch", "8.9", "--gib-per-job", "4",
                            "--reserve-gib", "4"]
    assert checkpoint_config(box.kernels) == (
        f"{box.kernels.home}/.cache/huggingface/hub/models--org--qwen/snapshots/"
        "4ff9003a3365/config.json")
    record.unlink()
    again = run_operation(box, command)
    assert len(again) == 1 and again[0].startswith(
        "FlashInfer kernels of vllm-qwen.service (stack ") and again[0].endswith(") built")
    assert not record.exists()  # not run again


def test_a_venv_without_flashinfer_builds_nothing_and_says_so(tmp_path: Path) -> None:
    """The testbed's stand-in engine has no FlashInfer (nor torch, here): one JSON line, exit 0."""
    config = tmp_path / "config.json"
    config.write_text('{"head_dim": 128, "torch_dtype": "float16"}')
    result = subprocess.run([sys.executable, "-I", str(SCRIPT), "--config", str(config),
                             "--dtype", "auto", "--arch", "8.9", "--gib-per-job", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["modules"] == {} and "no FlashInfer in this venv" in report["skipped"]
