"""`make lock` (donorkit/lock.py) against the testbed's STAND-IN for the Hugging Face hub
(tests/testbed/hub_standin.py, a real HTTP server on loopback; huggingface.co cannot be reached
from here), with the real huggingface_hub client; and the loader's refusal of a donor whose
model has no revision, before any connection."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from donorkit import lock
from donorkit.fleet import FleetError, check_revisions, load_fleet
from donorkit.paths import REPO_ROOT
from tests.testbed.hub_standin import generate_checkpoint, make_servers

QWEN = "turboderp/Qwen3.8-27B-exl3"      # defaults.yml's qwen checkpoint
OTHER = "standin/other-checkpoint"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    generate_checkpoint(root / QWEN, shard_bytes=1 << 16)
    (root / OTHER).mkdir(parents=True)
    (root / OTHER / "config.json").write_text('{"other": true}\n')
    return root


@pytest.fixture
def hub(hub_root, tmp_path):
    server, cdn, state = make_servers("127.0.0.1", 0, 0, tmp_path, hub_root)
    for s in (server, cdn):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    for s in (server, cdn):
        s.shutdown()
        s.server_close()


def donors(endpoint: str, extra: str = "") -> str:
    return textwrap.dedent(f"""\
        # the fleet (a comment lock must keep)
        overrides:
          hf_endpoint: {endpoint}
          hf_endpoint_plain_http_test_standin: true
          models:
            qwen:
              # pinned by make lock
              revision: null   # not yet
        donors:
          box-a:
            ssh_host: 192.0.2.10
            ssh_user: root
            card: rtx4090
            routes:
              hermes.ai.unturf.com: qwen
        """) + extra


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "donorkit.lock", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_lock_pins_the_branch_commit_in_the_file_that_defines_it(hub, tmp_path) -> None:
    url, state = hub
    path = tmp_path / "donors.yml"
    path.write_text(donors(url))
    result = run("--donors", str(path))
    commit = state.repos[QWEN].commit
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"lock: {path}: overrides.models.qwen: {QWEN} @ main: none -> {commit} "
        "(served by box-a)"]
    text = path.read_text()
    # Only the revision line changed; the comments stay.
    assert text == donors(url).replace("revision: null   # not yet",
                                       f"revision: {commit}  # not yet")
    assert load_fleet(path)["box-a"].models["qwen"].revision == commit
    again = run("--donors", str(path))
    assert again.returncode == 0 and again.stdout.endswith(": unchanged (served by box-a)\n")


def test_a_donor_with_its_own_checkpoint_gets_its_own_pin(hub, tmp_path) -> None:
    url, state = hub
    path = tmp_path / "donors.yml"
    path.write_text(donors(url, textwrap.indent(textwrap.dedent("""\
          box-b:
            ssh_host: 192.0.2.11
            ssh_user: root
            card: rtx3090
            routes:
              qwen.ai.unturf.com: qwen
            overrides:
              models:
                qwen:
                  checkpoint: standin/other-checkpoint
        """), "  ")))
    result = run("--donors", str(path))
    assert result.returncode == 0, result.stderr
    fleet = load_fleet(path)
    assert fleet["box-a"].models["qwen"].revision == state.repos[QWEN].commit
    assert fleet["box-b"].models["qwen"].revision == state.repos[OTHER].commit
    assert f"donors.box-b.overrides.models.qwen: {OTHER} @ main: none -> " in result.stdout


@pytest.mark.parametrize("case", ["unreachable", "branch", "all"])
def test_lock_refuses_to_guess_and_writes_nothing(hub, tmp_path, case: str) -> None:
    url, _ = hub
    path = tmp_path / "donors.yml"
    path.write_text(donors("http://127.0.0.1:9" if case == "unreachable" else url))
    before = path.read_text()
    args = {"unreachable": [], "branch": ["--branch", "no-such-branch"], "all": ["--all"]}[case]
    result = run("--donors", str(path), *args)
    assert result.returncode == 1, result.stdout
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("lock: REFUSED ") for line in lines), result.stderr
    assert all(line.endswith("nothing written") for line in lines), result.stderr
    if case == "unreachable":
        assert "ConnectError" in lines[0] and "127.0.0.1:9" in lines[0]
    elif case == "branch":
        assert "no-such-branch" in lines[0] and "RevisionNotFound" in lines[0]
    else:  # --all: also hermes (defaults.yml), which the stand-in does not have
        assert any("inventory/defaults.yml: models.hermes: solidrust/" in line for line in lines)
    assert path.read_text() == before
    assert "Traceback" not in result.stderr


def test_set_revision_adds_the_line_and_refuses_flow_style() -> None:
    text = "models:\n  qwen:\n    checkpoint: a/b\n    port: 1\n  hermes:\n    port: 2\n"
    sha = "a" * 40
    assert lock.set_revision(text, ("models", "qwen"), sha, "f") == (
        f"models:\n  qwen:\n    checkpoint: a/b\n    revision: {sha}\n    port: 1\n"
        "  hermes:\n    port: 2\n")
    with pytest.raises(lock.LockError, match="flow style"):
        lock.set_revision("models: {qwen: {checkpoint: a/b}}\n", ("models", "qwen"), sha, "f")


def test_the_loader_refuses_a_donor_whose_model_has_no_revision(tmp_path) -> None:
    path = tmp_path / "donors.yml"
    path.write_text(donors("https://huggingface.co").replace(
        "  hf_endpoint_plain_http_test_standin: true\n",
        "  vllm_exl3_plugin: {path: tests}\n"))
    fleet = load_fleet(path)
    with pytest.raises(FleetError) as err:
        check_revisions(fleet, path)
    assert str(err.value) == (
        f"{path}: donor 'box-a': field 'models.qwen.revision': not pinned: `make lock` "
        f"resolves {QWEN} at its branch (main) to its commit and writes it in")
    # The deploy's own entry point: one line, exit 2, before any connection.
    result = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), "inventory/gpus.py",
                             "debug-inventory"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={"DONORS_FILE": str(path),
                                             "PATH": str(Path(sys.executable).parent)})
    assert result.returncode != 0
    assert f"inventory error: {path}: donor 'box-a': field 'models.qwen.revision'" \
        in result.stderr, result.stderr
