"""The GPU harness (gpu/engine_run.py) starts vLLM from the units `make render` writes: what it
reads back from a rendered unit must be exactly what the deploy put there (ExecStart's words,
every Environment= pair, User=), or the GPU proof would prove another command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from donorkit.fleet import load_fleet
from donorkit.paths import REPO_ROOT
from donorkit.render import exec_start, render_unit, unit_environment
from gpu import engine_results, engine_run

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
