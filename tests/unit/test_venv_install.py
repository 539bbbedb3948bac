"""The venv step's pip command, rendered for each card profile of inventory/defaults.yml from
the same host data the deploy uses: what pip is asked to install, from where. The rtx3090's
CUDA 12.8 stack is what vLLM's install docs give for a CUDA variant: the release's
`vllm-<v>+cu128-cp38-abi3-manylinux_2_28_x86_64.whl` plus PyTorch's cu128 index."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from donorkit.fleet import DEFAULTS_FILE, load_fleet, read_yaml
from pyinfra_snapshot.operations import venv_packages
from pyinfra_snapshot.testing import plan

CARDS = sorted(read_yaml(DEFAULTS_FILE)["cards"])
RELEASE = "https://github.com/vllm-project/vllm/releases/download/v0.26.0"
EXPECTED = {
    "rtx4090": ("/opt/uncloseai/vllm-venv/bin/pip install -q --index-url https://pypi.org/simple "
                "vllm==0.26.0 torch==2.11.0 wheel==0.48.0 ninja==1.13.2"),
    "h200": ("/opt/uncloseai/vllm-venv/bin/pip install -q --index-url https://pypi.org/simple "
             "vllm==0.26.0 torch==2.11.0 wheel==0.48.0 ninja==1.13.2"),
    "rtx3090": ("/opt/uncloseai/vllm-venv/bin/pip install -q --index-url https://pypi.org/simple "
                "--extra-index-url https://download.pytorch.org/whl/cu128 "
                f"'vllm @ {RELEASE}/vllm-0.26.0+cu128-cp38-abi3-manylinux_2_28_x86_64.whl' "
                "torch==2.11.0 wheel==0.48.0 ninja==1.13.2"),
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


def pip_commands(data: dict, installed: dict[str, str]) -> list[str]:
    commands, _ = plan(venv_packages, {
        "venv_dir": data["venv_dir"], "packages": data["venv_requirements"],
        "install": data["venv_install_specs"], "install_args": data["venv_index_args"]},
        {"installed": installed})
    return commands


@pytest.mark.parametrize("card", CARDS)
def test_rendered_pip_install_per_card_profile(tmp_path: Path, card: str) -> None:
    assert set(CARDS) == set(EXPECTED), "a new card profile needs its expected pip command here"
    assert pip_commands(host_data(tmp_path, card), {}) == [EXPECTED[card]]


def test_3090_venv_is_converged_only_with_the_cu128_build(tmp_path: Path) -> None:
    data = host_data(tmp_path, "rtx3090")
    stack = {"torch": "2.11.0+cu128", "wheel": "0.48.0", "ninja": "1.13.2"}
    assert pip_commands(data, {**stack, "vllm": "0.26.0+cu128"}) == []  # the local tag is ours
    # PyPI's default build of the same version is not the CUDA 12.8 stack: reinstalled.
    assert pip_commands(data, {**stack, "vllm": "0.26.0"}) == [EXPECTED["rtx3090"]]
    assert data["vllm_installed_version"] == "0.26.0+cu128"
