"""The venv step's install command, rendered for each card profile of inventory/defaults.yml from
the same host data the deploy uses: what uv is asked to install, from where, and uv itself put in
the venv by its pip from the same index. The rtx3090's CUDA 12 stack is vLLM's cu129 variant as
its install docs give it: `uv pip install vllm==<v> --extra-index-url https://wheels.vllm.ai/<v>/
cu129 --extra-index-url https://download.pytorch.org/whl/cu129 --index-strategy unsafe-best-match`.
Neither of those two indexes can be reached from here: the command is checked as text, and its
options against the real uv (the pinned one, offline: uv parses every option, then finds nothing
to install)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from donorkit.inventory.fleet import DEFAULTS_FILE, load_fleet, read_yaml
from donorkit.render.templates import VENV_BUSY_MARKER
from pyinfra_declared.json_cases import plan
from pyinfra_declared.python_env import venv_packages

CARDS = sorted(read_yaml(DEFAULTS_FILE)["cards"])
UV_VERSION = read_yaml(DEFAULTS_FILE)["uv_version"]
VENV = "/opt/uncloseai/vllm-venv"
GET_UV = f"{VENV}/bin/pip install -q --index-url https://pypi.org/simple uv=={UV_VERSION} && "
UV = f"{VENV}/bin/uv pip install --python {VENV}/bin/python -q --system-certs"
EXPECTED = {
    "rtx4090": (f"{UV} --index-url https://pypi.org/simple "
                "vllm==0.26.0 torch==2.11.0 wheel==0.48.0 ninja==1.13.2"),
    "h200": (f"{UV} --index-url https://pypi.org/simple "
             "vllm==0.26.0 torch==2.11.0 wheel==0.48.0 ninja==1.13.2"),
    "rtx3090": (f"{UV} --index-url https://pypi.org/simple "
                "--extra-index-url https://wheels.vllm.ai/0.26.0/cu129 "
                "--extra-index-url https://download.pytorch.org/whl/cu129 "
                "--index-strategy unsafe-best-match "
                "vllm==0.26.0+cu129 torch==2.11.0+cu129 wheel==0.48.0 ninja==1.13.2"),
}


def host_data(tmp_path: Path, card: str) -> dict:
    donors = tmp_path / "donors.yml"
    donors.write_text(textwrap.dedent(f"""\
        donors:
          box-a:
            ssh_host: 192.0.2.10
            ssh_user: root
            card: {card}
            routes:
              qwen.ai.unturf.com: qwen
    """))
    return load_fleet(donors)["box-a"]


MARKER = f"{VENV}/{VENV_BUSY_MARKER}"


def commands(data: dict, installed: dict[str, str], interrupted: bool = False) -> list[str]:
    """The venv step's commands (`interrupted`: the box has the marker an install that did not
    finish leaves); the marker's making and removal are checked and cut off."""
    args = {"venv_dir": data.venv_dir, "packages": data.venv_requirements,
            "install": data.venv_install_specs, "install_args": data.venv_index_args,
            "uv": f"uv=={data.uv_version}", "busy_marker": VENV_BUSY_MARKER}
    busy = {MARKER: {"type": "regular empty file"}} if interrupted else {}
    found, _ = plan(venv_packages, args, {"installed": installed, "busy": busy})
    if found:
        assert len(found) == 1 and found[0].startswith(f"touch {MARKER} && "), found
        assert found[0].endswith(f" && rm -f {MARKER}"), found
        found = [found[0].removeprefix(f"touch {MARKER} && ").removesuffix(f" && rm -f {MARKER}")]
    return found


@pytest.mark.parametrize("card", CARDS)
def test_rendered_install_per_card_profile(tmp_path: Path, card: str) -> None:
    assert set(CARDS) == set(EXPECTED), "a new card profile needs its expected command here"
    data = host_data(tmp_path, card)
    # A fresh venv: uv first (from the same index, by the venv's pip), then the set.
    assert commands(data, {}) == [GET_UV + EXPECTED[card]]
    # A venv that has this uv (a re-run after a version bump): no pip step.
    assert commands(data, {"uv": UV_VERSION}) == [EXPECTED[card]]


def test_3090_venv_is_converged_only_with_the_cu129_build(tmp_path: Path) -> None:
    data = host_data(tmp_path, "rtx3090")
    stack = {"torch": "2.11.0+cu129", "wheel": "0.48.0", "ninja": "1.13.2"}
    assert commands(data, {**stack, "vllm": "0.26.0+cu129"}) == []  # the local tag is ours
    # PyPI's default (CUDA 13) build of the same version is not the CUDA 12 stack: reinstalled.
    assert commands(data, {**stack, "vllm": "0.26.0"}) == [GET_UV + EXPECTED["rtx3090"]]
    assert commands(data, {**stack, "torch": "2.11.0+cu130", "vllm": "0.26.0+cu129"}) == [
        GET_UV + EXPECTED["rtx3090"]]
    assert data.vllm_installed_version == "0.26.0+cu129"


def test_an_install_that_did_not_finish_is_done_again(tmp_path: Path) -> None:
    """uv installs in no order: a run killed during it can leave vllm and torch in place without
    some of their dependencies' files (the testbed's interrupted run: libcusparseLt.so.0
    missing). The marker it leaves makes the set unmet, and the next install reinstalls it."""
    data = host_data(tmp_path, "rtx4090")
    venv = {"vllm": "0.26.0", "torch": "2.11.0", "wheel": "0.48.0", "ninja": "1.13.2",
            "uv": UV_VERSION}
    assert commands(data, venv) == []
    assert commands(data, venv, interrupted=True) == [
        EXPECTED["rtx4090"].replace(" --system-certs ", " --system-certs --reinstall ")]


def test_the_marker_is_made_and_removed_in_a_real_shell(tmp_path: Path) -> None:
    """The command's first and last steps, in a real shell: the marker is there while uv runs
    and gone after it succeeded; a failing uv leaves it."""
    data = host_data(tmp_path, "rtx4090")
    found, _ = plan(venv_packages, {
        "venv_dir": data.venv_dir, "packages": data.venv_requirements,
        "install": data.venv_install_specs, "install_args": data.venv_index_args,
        "uv": f"uv=={data.uv_version}", "busy_marker": VENV_BUSY_MARKER},
        {"installed": {"uv": UV_VERSION}, "busy": {}})
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for exit_code in (0, 1):
        uv = venv / "bin/uv"
        uv.write_text(f"#!/bin/sh\ntest -e {venv}/{VENV_BUSY_MARKER} || exit 9\n"
                      f"exit {exit_code}\n")
        uv.chmod(0o755)
        result = subprocess.run(["sh", "-c", found[0].replace(VENV, str(venv))])
        assert result.returncode == exit_code
        assert (venv / VENV_BUSY_MARKER).exists() == bool(exit_code)


def test_4090_venv_converged_with_pypi_builds(tmp_path: Path) -> None:
    """The same check as before uv: distributions read from the venv; a venv without uv in it
    but with the whole set needs nothing."""
    data = host_data(tmp_path, "rtx4090")
    venv = {"vllm": "0.26.0", "torch": "2.11.0", "wheel": "0.48.0", "ninja": "1.13.2"}
    assert commands(data, venv) == []
    assert commands(data, dict(venv, ninja="1.11.1")) == [GET_UV + EXPECTED["rtx4090"]]


def test_the_controller_has_the_pinned_uv() -> None:
    """The uv the options are checked with below is the one the boxes get."""
    version = subprocess.run([str(Path(sys.executable).parent / "uv"), "--version"],
                             capture_output=True, text=True, check=True).stdout.split()[1]
    assert version == UV_VERSION


@pytest.mark.parametrize("card", CARDS)
def test_real_uv_takes_every_option_of_the_command(tmp_path: Path, card: str) -> None:
    """The command for each card, run by the real uv against a scratch venv with --offline
    --dry-run added: uv parses every option (a wrong one exits 2, 'unexpected argument'), then
    resolves offline and finds no vllm in its (empty) cache: exit 1 naming vllm."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")],
                   check=True)
    argv = shlex.split(EXPECTED[card])
    assert argv[:3] == [f"{VENV}/bin/uv", "pip", "install"]
    argv[0] = str(Path(sys.executable).parent / "uv")
    argv[argv.index("--python") + 1] = str(tmp_path / "v/bin/python")
    argv[3:3] = ["--offline", "--dry-run", "--cache-dir", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "unexpected argument" not in result.stderr
    assert "vllm was not found in the cache" in result.stderr, result.stderr


def test_a_changed_set_removes_the_kernels_shipped_for_the_old_one(tmp_path: Path) -> None:
    """FlashInfer loads a kernel from its folder of precompiled kernels without asking which
    version built it (donorkit/box/kernel_cache.py ships them there): a change of the venv's set
    removes that folder before uv runs, in a real shell; a converged venv keeps it."""
    from donorkit.box.kernel_cache import FLASHINFER_AOT

    data = host_data(tmp_path, "rtx4090")
    args = {"venv_dir": data.venv_dir, "packages": data.venv_requirements,
            "install": data.venv_install_specs, "install_args": data.venv_index_args,
            "uv": f"uv=={data.uv_version}", "busy_marker": VENV_BUSY_MARKER,
            "stale_on_change": [FLASHINFER_AOT]}
    venv = tmp_path / "venv"
    kernel = venv / "lib/python3.12/site-packages/flashinfer/data/aot/k/k.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"old")
    (venv / "bin").mkdir()
    uv = venv / "bin/uv"
    uv.write_text(f"#!/bin/sh\ntest ! -e {kernel.parent} || exit 9\n")  # gone before uv runs
    uv.chmod(0o755)
    converged = {"vllm": "0.26.0", "torch": "2.11.0", "wheel": "0.48.0", "ninja": "1.13.2",
                 "uv": UV_VERSION}
    assert plan(venv_packages, args, {"installed": converged, "busy": {}})[0] == []
    found, _ = plan(venv_packages, args, {"installed": {**converged, "vllm": "0.25.1"},
                                          "busy": {}})
    assert subprocess.run(["sh", "-c", found[0].replace(VENV, str(venv))]).returncode == 0
    assert not kernel.exists() and kernel.parents[2].is_dir()  # flashinfer/ itself stays
