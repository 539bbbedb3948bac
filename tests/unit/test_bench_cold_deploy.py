"""Smoke run of bench/cold_deploy.py without test hosts (so the benchmark cannot rot between its
runs on the testbed): its by-hand scripts are valid shell with the pinned versions, its phase
timing reads a real pyinfra run's log, and its donors files (and bench/noop_rerun.py's) load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cold_deploy
from donorkit.inventory.fleet import DEFAULTS_FILE, load_fleet, read_yaml

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(("installer", "cache"), [("pip", None), ("uv", None),
                                                  ("uv", "/tmp/uv-empty")])
def test_hand_scripts_are_shell_with_the_pinned_versions(installer: str, cache: str | None) -> None:
    defaults = read_yaml(DEFAULTS_FILE)
    packages, wheel = cold_deploy.hand_script(installer, "/tmp/exllamav3-1.5.1-x.whl", cache)
    for script in (packages, wheel):
        result = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    assert f"vllm=={defaults['vllm_version']}" in packages
    assert "cuda-toolkit-13-3" in packages
    assert ("uv pip install" in packages) == (installer == "uv")
    assert (f"--cache-dir {cache}" in packages) == bool(cache)
    assert "pip install -q --no-deps /tmp/exllamav3-1.5.1-x.whl" in wheel


def test_stamped_steps_from_a_real_shell() -> None:
    script = f"{cold_deploy.STAMP}\nstep a\nsleep 0.2\nstep b\nstep done\n"
    output = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                            check=True).stdout
    steps = cold_deploy.stamped_steps(output)
    assert set(steps) == {"a", "b"} and 0.15 < steps["a"] < 2 and steps["b"] < 0.2


@pytest.mark.parametrize("style", ["deploys", "included files"])
def test_phases_from_a_real_pyinfra_log(tmp_path: Path, style: str) -> None:
    """pyinfra on @local, a deploy of two steps named as ours (pyinfra deploys, as this deploy's
    tasks/ are, or included task files, as a --baseline revision's): the phases are theirs."""
    (tmp_path / "tasks").mkdir()
    if style == "deploys":
        (tmp_path / "steps.py").write_text(
            "from pyinfra.api import deploy\nfrom pyinfra.operations import server\n\n\n"
            "@deploy('CUDA toolkit')\ndef cuda():\n"
            "    server.shell(name='Wait in cuda', commands=['sleep 0.5'])\n\n\n"
            "@deploy('vLLM venv')\ndef venv():\n"
            "    server.shell(name='Wait in venv', commands=['sleep 0.5'])\n")
        (tmp_path / "deploy.py").write_text("import steps\nsteps.cuda()\nsteps.venv()\n")
    else:
        (tmp_path / "deploy.py").write_text("from pyinfra import local\n"
                                            "local.include('tasks/cuda.py')\n"
                                            "local.include('tasks/vllm_venv.py')\n")
        for name in ("cuda", "vllm_venv"):
            (tmp_path / f"tasks/{name}.py").write_text(
                "from pyinfra.operations import server\n"
                f"server.shell(name='Wait in {name}', commands=['sleep 0.5'])\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([str(BIN / "pyinfra"), "-y", "@local", "deploy.py"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    starts = [i for i, line in enumerate(lines) if "Starting operation" in line]
    assert len(starts) == 2, lines
    # Timestamps as the bench takes them, here made up: 1 s apart per line.
    phases = cold_deploy.phases_of([(float(i), line) for i, line in enumerate(lines)],
                                   float(len(lines)))
    assert list(phases) == ["connect + plan", "CUDA packages", "venv"], phases
    assert phases["CUDA packages"] == starts[1] - starts[0]
    assert sum(phases.values()) == len(lines)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_bench_donors_files_load(tmp_path: Path, size: int) -> None:
    names = [(f"tb-cold{i}", f"10.213.0.{60 + i}") for i in range(1, size + 1)]
    cache = tmp_path / "cache"
    fleet = load_fleet(cold_deploy.bench_donors(names, tmp_path / "donors.yml", cache))
    assert sorted(fleet) == [n for n, _ in names]
    assert {box.exllamav3_wheel_cache for box in fleet.values()} == {str(cache)}


def test_export_tree_gives_the_deploy_at_a_revision(tmp_path: Path) -> None:
    tree = cold_deploy.export_tree("HEAD", tmp_path / "tree")
    assert (tree / "deploy.py").is_file() and (tree / "inventory/gpus.py").is_file()
