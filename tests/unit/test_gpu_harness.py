"""The GPU harness (gpu/engine_run.py) starts vLLM from the units `make render` writes: what it
reads back from a rendered unit must be exactly what the deploy put there (ExecStart's words,
every Environment= pair, User=), or the GPU proof would prove another command line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from donorkit.inventory.fleet import load_fleet
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render.templates import exec_start, render_unit, unit_environment
from gpu import carried_set, engine_results, engine_run

ENGINE_DONORS = REPO_ROOT / "gpu/engine.yml"


@pytest.mark.parametrize("donor, model", [("h200-qwen", "qwen"), ("h200-hermes", "hermes")])
def test_the_harness_reads_back_what_the_deploy_rendered(tmp_path: Path, donor: str,
                                                         model: str) -> None:
    data = load_fleet(ENGINE_DONORS)[donor]
    profile = data.models[model]
    unit = tmp_path / profile.unit
    unit.write_text(render_unit(data, profile))
    user, env, argv = engine_run.read_unit(unit)
    assert user == data.service_user
    assert env == unit_environment(data, profile)
    assert argv == exec_start(data, profile)
    assert argv[argv.index("--attention-backend") + 1] == "FLASHINFER"  # the h200 card's flag


def test_the_engine_units_carry_the_profiles_environment() -> None:
    fleet = load_fleet(ENGINE_DONORS)
    qwen = unit_environment(fleet["h200-qwen"], fleet["h200-qwen"].models["qwen"])
    hermes = unit_environment(fleet["h200-hermes"], fleet["h200-hermes"].models["hermes"])
    assert qwen["VLLM_PREFIX_CACHE_RETENTION_INTERVAL"] == "6400"
    assert "VLLM_PREFIX_CACHE_RETENTION_INTERVAL" not in hermes
    assert qwen["CUDA_HOME"] == hermes["CUDA_HOME"] == "/usr/local/cuda-13.3"  # the 4090's


def test_only_the_plugin_flag_is_dropped() -> None:
    data = load_fleet(ENGINE_DONORS)["h200-qwen"]
    argv = exec_start(data, data.models["qwen"])
    kept = engine_run.without(argv, "--quantization", "exl3")
    assert len(kept) == len(argv) - 2 and "exl3" not in kept
    assert engine_run.without(kept, "--quantization", "exl3") == kept


def test_phases_read_from_the_recorded_engine_logs() -> None:
    """The start-up phases come from vLLM 0.26.0's own log lines (the H200 run's logs, kept):
    a cold start spends minutes in FlashInfer's JIT, a warm one reuses every cache."""
    results = REPO_ROOT / "gpu/results/h200-engine-2026-12-01"
    cold = engine_results.phases((results / "qwen-cold.log").read_text(errors="replace"))
    warm = engine_results.phases((results / "qwen-warm.log").read_text(errors="replace"))
    assert cold == {"torch_compile_s": 14.35, "init_engine_s": 278.27,
                    "flashinfer_autotune_s": 111, "attention_warmup_s": 32,
                    "after_graphs_s": 102}
    assert warm["init_engine_s"] == 28.14 and warm["flashinfer_autotune_s"] == 0
    assert engine_results.phases("no vLLM lines here") == {}


# ------------------------------------------------------------------ with the GPU image's python --

DRY_RUN = REPO_ROOT / "tests/support/gpu_image_dry_run.py"


def in_the_image(*args: str) -> subprocess.CompletedProcess:
    """`python -I` (no PYTHONPATH, no user site, not the current folder) with the dry run's
    import blocker: only the standard library, this repository and psutil."""
    return subprocess.run([sys.executable, "-I", str(DRY_RUN), *args], cwd="/",
                          capture_output=True, text=True, timeout=300)


def test_the_blocker_refuses_what_the_gpu_image_lacks() -> None:
    """The guard can fail: pydantic (donorkit.commands.accept_records's) is refused as on the GPU
    machine."""
    result = in_the_image("--import", "donorkit.commands.accept_records")
    assert result.returncode == 1
    assert "in the GPU image (blocked)" in result.stderr  # yaml or pydantic, whichever first


def stage_chunks(tmp_path: Path) -> Path:
    """What `make gpu-engine-carry` carries, in small: the rendered units of gpu/engine.yml (as
    engine_carry renders them), an empty wheel table and the stand-ins' configs, in two chunks."""
    work = tmp_path / "work"
    stage = work / "build/stage"
    donors = yaml.safe_load(ENGINE_DONORS.read_text())
    donors["overrides"]["pki_dir"] = str(tmp_path / "pki")
    (tmp_path / "engine.yml").write_text(yaml.safe_dump(donors))
    for donor in ("h200-qwen", "h200-hermes"):
        subprocess.run([sys.executable, "-m", "donorkit.commands.render_cli", donor,
                        str(stage / "render" / donor)], cwd=REPO_ROOT, check=True,
                       env={**os.environ, "DONORS_FILE": str(tmp_path / "engine.yml")},
                       capture_output=True)
    (stage / "requirements.json").write_text(json.dumps({"carried": {}, "excluded": {}}))
    for name in ("qwen", "qwen-next", "hermes"):
        (stage / "models" / name).mkdir(parents=True)
        (stage / "models" / name / "config.json").write_text('{"head_dim": 256}')
    archive = work / "stage.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(stage, arcname="stage")
    data = archive.read_bytes()
    half = len(data) // 2
    for i, part in enumerate((data[:half], data[half:]), 1):
        (work / f"carry/{i:02d}").mkdir(parents=True)
        (work / f"carry/{i:02d}/part").write_bytes(part)
    (work / "carry/01/manifest").write_text(f"2 {hashlib.sha256(data).hexdigest()}\n")
    return work


def test_every_step_runs_with_only_what_the_gpu_image_has(tmp_path: Path) -> None:
    """receive, launch, the daemon's every run (prebuild, cold, warm, warm-no-autotune; the engines
    exit at once, so the fallback checkpoint's cold run follows), follow and table, under
    `python -I` with the blocker: the toolkit step's import chain (tests/support/cuda_standin ->
    common) once reached pydantic there, and nothing host-free saw it."""
    work = stage_chunks(tmp_path)
    result = in_the_image(str(work))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "STEPS DONE" in result.stdout
    results = json.loads((work / "engine/results/results.json").read_text())
    assert results["toolkit"]["seconds"] >= 0 and "finished" in results
    assert results["prebuild"]["command"][1].endswith("/bin/prebuild_kernels.py")
    runs = [(r["run"], r["snapshot"].split("@")[0]) for r in results["runs"]]
    assert runs == [("cold", "qwen"), ("cold", "qwen-next"), ("warm", "qwen-next"),
                    ("warm-no-autotune", "qwen-next")]
    assert results["runs"][-1]["exec_start"][-1] == "--no-enable-flashinfer-autotune"
    emptied = [r["run"] for r in results["runs"] if any("empty caches" in n for n in r["notes"])]
    assert emptied == ["cold", "cold"]  # the restarts, with and without the autotuner, keep them
    # The prebuilt module kept its name when the first engine rebuilt it: the daemon says so.
    assert [r["jit_kernels_the_engine_rebuilt"] for r in results["runs"]] == [
        ["sampling"], [], [], []]
    assert all(r["jit_kernels_the_engine_built"] == [] for r in results["runs"])
    # The service user's home, whose caches the daemon empties, is under WORK, not this user's.
    assert results["prebuild"]["command"][3].startswith(str(work / "home") + "/")
    assert all("--quantization" not in r["exec_start"] for r in results["runs"])
    assert (work / "out/results.json").exists() and (work / "engine/results/table.md").exists()


# ------------------------------------------------------------------ what goes into the venv ------

def test_a_carried_version_that_stays_out_asks_for_nothing() -> None:
    """The 2026-12-03 evening run: the carried set's transformers 5.25 asked for huggingface-hub
    >= 2.4; the image's transformers 5.17 stays (inside vLLM's >= 4.56), so its hub stays too:
    installing hub 2.4 had broken the image's transformers at import, and every engine."""
    table = {
        "vllm": {"required_by": [], "specifiers": []},
        "ninja": {"required_by": [], "specifiers": []},
        "transformers": {"required_by": ["vllm"], "specifiers": [">=4.56"]},
        "huggingface-hub": {"required_by": ["tokenizers", "transformers"],
                            "specifiers": ["<3.0,>=0.16.4", "<3.0,>=2.4.0"]},
        "tokenizers": {"required_by": ["vllm"], "specifiers": [">=0.21"]},
        "blake3": {"required_by": ["vllm"], "specifiers": [">=1"]},
    }
    image = {"transformers": "5.17.0", "huggingface-hub": "1.9.0", "tokenizers": "0.22.1"}
    assert carried_set.to_install(table, image.get) == ["blake3", "ninja", "vllm"]


def test_a_carried_version_that_goes_in_pulls_what_it_asks_for() -> None:
    """Until nothing changes: vllm asks for a newer transformers, which goes in, and its hub
    requirement then counts."""
    table = {
        "vllm": {"required_by": [], "specifiers": []},
        "transformers": {"required_by": ["vllm"], "specifiers": [">=5.20"]},
        "huggingface-hub": {"required_by": ["transformers"], "specifiers": ["<3.0,>=2.4.0"]},
        "tokenizers": {"required_by": ["transformers"], "specifiers": [">=0.22"]},
    }
    image = {"transformers": "5.17.0", "huggingface-hub": "1.9.0", "tokenizers": "0.22.1"}
    assert carried_set.to_install(table, image.get) == ["huggingface-hub", "transformers",
                                                         "vllm"]
