"""FlashInfer's kernels built before a unit's first start (files/prebuild_kernels.py, run by
donorkit/box/prebuild.py's operation): the script's own reading of the model and of the box's
memory, and the operation's command run for real in a shell as the service user, once per stack.
What the build itself does with the real FlashInfer was measured on the GPU machine (docs/gpu.md,
gpu/results/h200-engine-2026-12-03-qwen35: four modules in 115 s); where ninja keeps its log, so
that the engine's own build finds nothing to do, is checked here with the real ninja (the sixth
GPU run showed the engine rebuilding modules a one-ninja prebuild had built)."""

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


# ------------------------------------------------------------------ where ninja keeps its state -

class JitSpec:
    """TEST DOUBLE of FlashInfer 0.6.14's JitSpec (flashinfer/jit/core.py), only what the
    prebuild and the engine use, with their ninja calls as FlashInfer makes them (cpp_ext.py's
    run_ninja: `ninja -v -C WORKDIR -f FILE [-j MAX_JOBS]`), compiling a C file with gcc instead
    of CUDA with nvcc. `build()` is what the engine runs on every load (build_and_load):
    ninja in the module's own folder, cached_ops/NAME."""

    def __init__(self, jit_dir: Path, name: str) -> None:
        self.name, self.jit_dir = name, jit_dir
        self.build_dir = jit_dir / name
        self.ninja_path = self.build_dir / "build.ninja"
        self.jit_library_path = self.build_dir / f"{name}.so"

    def write_ninja(self) -> None:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        source = self.build_dir / "kernel.c"
        if not source.exists():
            source.write_text("int kernel(void) { return 1; }\n")
        obj, lib = self.build_dir / "kernel.o", self.jit_library_path
        self.ninja_path.write_text(
            "ninja_required_version = 1.3\n"
            "rule cc\n  command = gcc -MD -MF $out.d -fPIC -c $in -o $out\n"
            "  depfile = $out.d\n  deps = gcc\n"
            "rule link\n  command = gcc -shared $in -o $out\n"
            f"build {obj}: cc {source}\nbuild {lib}: link {obj}\ndefault {lib}\n")

    def build(self, verbose: bool) -> None:
        self.write_ninja()
        run_ninja(self.build_dir, self.ninja_path)


def run_ninja(workdir: Path, ninja_file: Path) -> str:
    return subprocess.run([NINJA, "-v", "-C", str(workdir), "-f", str(ninja_file), "-j", "2"],
                          capture_output=True, text=True, check=True).stdout


def build_jit_specs(specs: list[JitSpec]) -> None:
    """FlashInfer 0.6.14's build_jit_specs (jit/core.py), which the prebuild used until 0.19.1:
    one ninja over the modules' files as subninjas, run in cached_ops/."""
    for one in specs:
        one.write_ninja()
    top = specs[0].jit_dir / "tmp/flashinfer_jit.ninja"
    top.parent.mkdir(parents=True, exist_ok=True)
    top.write_text("ninja_required_version = 1.3\n" +
                   "".join(f"subninja {one.ninja_path}\n" for one in specs))
    run_ninja(specs[0].jit_dir, top)


NINJA = str(Path(sys.executable).with_name("ninja"))


def engines_ninja_would_run(spec: JitSpec) -> str:
    """What ninja would do when the engine loads the module (`-n`: nothing run), with its reason."""
    done = subprocess.run([NINJA, "-n", "-d", "explain", "-C", str(spec.build_dir), "-f",
                           str(spec.ninja_path)], capture_output=True, text=True, check=True)
    return done.stdout + done.stderr  # ninja explains on stderr


def test_the_prebuild_leaves_each_module_as_the_engine_finds_nothing_to_do(
        tmp_path: Path) -> None:
    sampling = JitSpec(tmp_path / "cached_ops", "sampling")
    assert prebuild_script.build_like_the_engine(sampling) == "built"
    assert (sampling.build_dir / ".ninja_log").exists()
    assert "no work to do" in engines_ninja_would_run(sampling)
    assert prebuild_script.build_like_the_engine(sampling) == "up to date"


def test_the_one_ninja_way_made_the_engine_build_again(tmp_path: Path) -> None:
    """The negative: FlashInfer's build_jit_specs leaves ninja's deps and log in cached_ops/,
    none in the module's folder, and the engine's ninja then rebuilds every object (on the H200:
    420 s, inside the unit). Ninja 1.13.2's reason, as with FlashInfer's own build files
    (gpu/results/prebuild-ninja-check-2026-12-03.txt): the objects' deps are missing."""
    sampling = JitSpec(tmp_path / "cached_ops", "sampling")
    build_jit_specs([sampling])
    assert sampling.jit_library_path.exists()
    explained = engines_ninja_would_run(sampling)
    assert f"deps for '{sampling.build_dir / 'kernel.o'}' are missing" in explained
    assert "no work to do" not in explained
