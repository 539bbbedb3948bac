"""The venv step's install command, rendered for each card profile of inventory/defaults.yml from
the same host data the deploy uses: what uv is asked to install, from where, and uv itself put in
the venv by its pip from the same index. The rtx3090's CUDA 12 stack is vLLM's cu129 variant as
its install docs give it: `uv pip install vllm==<v> --extra-index-url https://wheels.vllm.ai/<v>/
cu129 --extra-index-url https://download.pytorch.org/whl/cu129 --index-strategy unsafe-best-match`.
Neither of those two indexes can be reached from here: the command is checked as text, and its
options against the real uv (the pinned one, offline: uv parses every option, then finds nothing
to install)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from donorkit.fleet import DEFAULTS_FILE, load_fleet, read_yaml
from pyinfra_snapshot.operations import venv_packages
from pyinfra_snapshot.testing import plan

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


STAMP = f"{VENV}/.uncloseai-installed"


def commands(data: dict, installed: dict[str, str], stamp_sha256: str | None = "as written",
             strip: bool = True) -> list[str]:
    """The venv step's commands; `stamp_sha256`: the completion stamp's digest on the box
    ("as written": what this step's own command writes, i.e. the last install finished; None:
    no stamp). With `strip`, the stamp's removal and writing are checked and cut off."""
    args = {"venv_dir": data["venv_dir"], "packages": data["venv_requirements"],
            "install": data["venv_install_specs"], "install_args": data["venv_index_args"],
            "uv": f"uv=={data['uv_version']}"}
    if stamp_sha256 == "as written":
        stamp_sha256 = written_stamp(commands(data, {}, None, strip=False)[0])
    done = {STAMP: {"type": "regular file", "sha256": stamp_sha256}} if stamp_sha256 else {}
    found, _ = plan(venv_packages, args, {"installed": installed, "done": done})
    if strip and found:
        assert len(found) == 1 and found[0].startswith(f"rm -f {STAMP} && "), found
        head, tail = found[0].removeprefix(f"rm -f {STAMP} && ").rsplit(" && printf %s ", 1)
        assert re.fullmatch(rf"[0-9a-f]{{64}} > {re.escape(STAMP)}", tail), tail
        found = [head]
    return found


def written_stamp(command: str) -> str:
    """sha256 of the stamp the command's last step writes, run in a real shell."""
    printf = "printf %s " + command.rsplit(" && printf %s ", 1)[1].split(" > ")[0]
    out = subprocess.run(["sh", "-c", printf], capture_output=True, check=True).stdout
    return hashlib.sha256(out).hexdigest()


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
    assert data["vllm_installed_version"] == "0.26.0+cu129"


def test_an_install_that_did_not_finish_is_done_again(tmp_path: Path) -> None:
    """uv installs in no order: a run killed during it can leave vllm and torch in place without
    some of their dependencies (the testbed's interrupted run: libcusparseLt missing). Without
    the completion stamp its command writes last, every requirement met is not converged."""
    data = host_data(tmp_path, "rtx4090")
    venv = {"vllm": "0.26.0", "torch": "2.11.0", "wheel": "0.48.0", "ninja": "1.13.2"}
    assert commands(data, venv) == []
    assert commands(data, venv, stamp_sha256=None) == [GET_UV + EXPECTED["rtx4090"]]
    assert commands(data, dict(venv, uv=UV_VERSION), stamp_sha256="0" * 64) == [
        EXPECTED["rtx4090"]]
    # Another card's stamp (another set asked) is not this set's.
    other = written_stamp(commands(host_data(tmp_path, "rtx3090"), {}, None, strip=False)[0])
    assert commands(data, venv, stamp_sha256=other) == [GET_UV + EXPECTED["rtx4090"]]


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
