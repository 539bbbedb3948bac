"""The weights step and the readiness gate as operations (donorkit/box/serving.py): facts in,
commands out, converged = no command; their facts' commands run in a real shell against the real
programs (files/fetch_weights.py's check, the vLLM stand-in's /v1/models)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand
from pyinfra.context import ctx_host

from donorkit.box.serving import ModelsListed, WeightsComplete, model_weights, ready_gate
from donorkit.commands.transport import wait_until
from donorkit.inventory.paths import REPO_ROOT
from pyinfra_declared.json_cases import CaseHost, refusal_message

REV = "4ff9003a33658da90d0bc7977d0251d39075a663"
WEIGHTS = dict(model="qwen", repo="turboderp/Qwen3.8-27B-exl3", revision=REV,
               python="/opt/uncloseai/vllm-venv/bin/python",
               script="/opt/uncloseai/bin/fetch_weights.py", service_user="fox",
               home="/home/fox", cache_dir="/home/fox/.cache/huggingface/hub",
               manifests="/home/fox/.cache/uncloseai/weights",
               endpoint="https://huggingface.co", token_file=None)
GATE = dict(unit="vllm-qwen.service", port=18888, checkpoint="turboderp/Qwen3.8-27B-exl3",
            python="python3", script="/opt/uncloseai/bin/wait_ready.py",
            timeout=1800, journal_lines=30)


def shell_of(command: FunctionCommand) -> str:
    """The shell command the operation runs with its output streamed (a FunctionCommand)."""
    assert isinstance(command, FunctionCommand)
    return command.args[0]


def plan(op, **args_and_facts) -> tuple[list, list[str]]:
    fake = CaseHost()
    with ctx_host.use(fake):
        return list(op.plan(**args_and_facts)), fake.noops


def test_weights_converged_is_no_command():
    assert plan(model_weights, **WEIGHTS, complete=True) == (
        [], [f"turboderp/Qwen3.8-27B-exl3@{REV[:12]} complete in /home/fox/.cache/huggingface/hub"])
    local = {**WEIGHTS, "repo": "/srv/models/qwen"}
    assert plan(model_weights, **local, complete=None)[0] == []


def test_weights_missing_runs_the_fetcher_as_the_service_user():
    [command], noops = plan(model_weights, **WEIGHTS, complete=False)
    assert noops == []
    assert shell_of(command) == (
        "cd / && runuser -u fox -- env HOME=/home/fox HF_HOME=/home/fox/.cache/huggingface "
        "/opt/uncloseai/vllm-venv/bin/python /opt/uncloseai/bin/fetch_weights.py "
        f"--repo turboderp/Qwen3.8-27B-exl3 --revision {REV} "
        "--cache-dir /home/fox/.cache/huggingface/hub "
        "--manifest-dir /home/fox/.cache/uncloseai/weights --endpoint https://huggingface.co")
    [with_token], _ = plan(model_weights, **{**WEIGHTS, "token_file": "/opt/uncloseai/s/t x"},
                           complete=False)
    # Opened by the root shell, read by the fetch on stdin (the service user cannot open it).
    assert shell_of(with_token).endswith("--token-stdin < '/opt/uncloseai/s/t x'")


def test_weights_without_a_pinned_revision_refuse_the_host():
    commands, _ = plan(model_weights, **{**WEIGHTS, "revision": None}, complete=None)
    assert "models.qwen.revision is not set: pin the commit of turboderp/Qwen3.8-27B-exl3" \
        in refusal_message([str(c) for c in commands])
    commands, _ = plan(model_weights, **WEIGHTS, token_error="hf_token_file t: No such file",
                       complete=False)
    assert refusal_message([str(c) for c in commands]).endswith("hf_token_file t: No such file")


def test_gate_is_no_command_when_the_model_is_listed():
    assert plan(ready_gate, **GATE, listed=["turboderp/Qwen3.8-27B-exl3"])[0] == []
    for listed in (None, [], ["other/model"]):
        [command], _ = plan(ready_gate, **GATE, listed=listed)
        # Run as root: the system's Python, isolated and without site-packages (issue 32).
        assert shell_of(command) == (
            "python3 -I -S /opt/uncloseai/bin/wait_ready.py "
            "--unit vllm-qwen.service --port 18888 --model turboderp/Qwen3.8-27B-exl3 "
            "--timeout 1800 --journal-lines 30")


def run_fact(fact, **kwargs):
    out = subprocess.run(["sh", "-c", fact.command(**kwargs)], capture_output=True, text=True)
    return fact.process(out.stdout.splitlines())


def test_weights_fact_reads_the_fetchers_manifest(tmp_path: Path):
    args = dict(python=sys.executable, script=str(REPO_ROOT / "files/fetch_weights.py"),
                repo="org/name", revision=REV, cache_dir=str(tmp_path / "hub"),
                manifests=str(tmp_path / "m"))
    assert run_fact(WeightsComplete(), **args) is False
    snapshot = tmp_path / "hub/models--org--name/snapshots" / REV
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    manifest = tmp_path / "m/models--org--name" / f"{REV}.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"repo": "org/name", "revision": REV,
                                    "files": {"config.json": 2}}))
    assert run_fact(WeightsComplete(), **args) is True
    (snapshot / "config.json").write_text("{ }")  # a file of another size: not complete
    assert run_fact(WeightsComplete(), **args) is False
    assert run_fact(WeightsComplete(), **{**args, "python": "/nonexistent/python"}) is False


@pytest.fixture
def standin_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/testbed/standins/vllm-standin"),
                             "serve", "org/model", "--host", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, "VLLM_STANDIN_LOAD_DELAY": "1"},
                            stderr=subprocess.DEVNULL)
    yield port
    proc.terminate()
    proc.wait()


def test_models_listed_fact_against_the_standin(standin_port):
    seen = []

    def listed() -> str | None:
        seen.append(run_fact(ModelsListed(), port=standin_port))
        return None if seen[-1] == ["org/model"] else "not listed yet"

    wait_until(listed, 10, 0.2)
    assert seen[-1] == ["org/model"], seen
    assert [] in seen  # up, but not loaded yet: listed nothing
    # Read inside the run's one-command snapshot, it must come back as its own section.
    from pyinfra_declared.snapshot import Snapshot
    command = Snapshot().command([ModelsListed().command(port=standin_port), "echo after"])
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout
    sections = Snapshot().process(out.splitlines())
    assert [status for status, _ in sections] == [0, 0], out
    assert ModelsListed().process(sections[0][1]) == ["org/model"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert run_fact(ModelsListed(), port=free) is None
