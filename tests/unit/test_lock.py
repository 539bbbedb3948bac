"""`make lock` (donorkit/commands/pin.py) against the testbed's STAND-IN for the Hugging Face hub
(tests/support/hub_standin.py, a real HTTP server on loopback; huggingface.co cannot be reached
from here), with the real huggingface_hub client; and the loader's refusal of a donor whose
model has no revision, before any connection."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from donorkit.commands import pin as lock
from donorkit.inventory.fleet import FleetError, check_revisions, load_fleet
from donorkit.inventory.paths import REPO_ROOT
from tests.support.hub_standin import generate_checkpoint, make_servers

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
    return subprocess.run([sys.executable, "-m", "donorkit.commands.pin", *args], cwd=REPO_ROOT,
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
        f"{path}: donor 'box-a': field 'models.qwen.revision': not pinned: `donors pin` "
        f"resolves {QWEN} at its branch (main) to its commit and writes it in")
    # The deploy's own entry point: one line, exit 2, before any connection.
    result = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), "inventory/gpus.py",
                             "debug-inventory"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={"DONORS_FILE": str(path),
                                             "PATH": str(Path(sys.executable).parent)})
    assert result.returncode != 0
    assert f"inventory error: {path}: donor 'box-a': field 'models.qwen.revision'" \
        in result.stderr, result.stderr


# --- a hub that is not to be believed (issue 32, hole 7): real HTTP servers on loopback --------
SHA = "b" * 40


def _json(handler, doc: dict, status: int = 200) -> None:
    body = json.dumps(doc).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def http_server(answer, address: str = "127.0.0.1") -> Iterator[str]:
    """An HTTP server answering every GET with `answer(handler)`; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                answer(self)
            except OSError:
                pass  # the client gave up

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((address, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{address}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _trickle(handler) -> None:
    body = json.dumps({"id": QWEN, "sha": SHA}).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    for byte in body:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.3)


HOSTILE_HUBS = {
    # Another host's answer, reached by a redirect.
    "redirect": lambda other: lambda h: (h.send_response(302), h.send_header(
        "Location", f"{other}{h.path}"), h.send_header("Content-Length", "0"), h.end_headers()),
    # 4 MiB of answer around a good commit.
    "huge": lambda _: lambda h: _json(h, {"id": QWEN, "sha": SHA, "pad": "x" * (4 << 20)}),
    # A good commit, one byte every 0.3 s (about 20 s): each read well within any timeout.
    "trickle": lambda _: _trickle,
    # A commit with a newline after it.
    "newline": lambda _: lambda h: _json(h, {"id": QWEN, "sha": SHA + "\n"}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HUBS))
def test_lock_pins_only_what_the_configured_hub_says_bounded(tmp_path, case: str) -> None:
    """Refused in one line, nothing written, within the timeout (2 s here): a redirect to
    another host (127.0.0.2 answers with its own commit), an answer past HUB_ANSWER_LIMIT, one
    that trickles, a commit followed by a newline."""
    with http_server(lambda h: _json(h, {"id": QWEN, "sha": "f" * 40}),
                     "127.0.0.2") as other, http_server(HOSTILE_HUBS[case](other)) as hub:
        path = tmp_path / "donors.yml"
        path.write_text(donors(hub))
        before = path.read_text()
        started = time.monotonic()
        result = run("--donors", str(path), "--timeout", "2")
        elapsed = time.monotonic() - started
    assert result.returncode == 1, (result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    assert line.startswith(f"lock: REFUSED {path}: overrides.models.qwen: {QWEN} @ main from "
                           f"{hub}: ") and line.endswith("; nothing written"), line
    assert {"redirect": f"OffHub: the hub redirected to {other}/api/models/{QWEN}/revision/"
                        f"main, not {hub}: not followed",
            "huge": f"AnswerTooLarge: {hub}/api/models/{QWEN}/revision/main: answer longer "
                    f"than {lock.HUB_ANSWER_LIMIT} bytes",
            "trickle": f"TimeoutError: {hub}/api/models/{QWEN}/revision/main: no whole answer "
                       "within 2 s",
            "newline": f"the hub answered no 40-hex commit ('{SHA}\\\\n')"}[case] in line, line
    assert path.read_text() == before
    assert elapsed < 12  # the interpreter's start, and 2 s


def test_lock_follows_a_redirect_on_the_hub_itself(tmp_path) -> None:
    """The hub moves a renamed repository's API path on its own origin: followed."""
    def answer(handler) -> None:
        if "/api/models/old/" in handler.path:
            handler.send_response(307)
            handler.send_header("Location", handler.path.replace("/old/", "/new/"))
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        else:
            _json(handler, {"id": QWEN, "sha": SHA})

    with http_server(answer) as hub:
        path = tmp_path / "donors.yml"
        path.write_text(donors(hub).replace("      # pinned by make lock\n",
                                            "      checkpoint: old/name\n"))
        result = run("--donors", str(path), "--timeout", "5")
    assert result.returncode == 0, result.stderr
    assert load_fleet(path)["box-a"].models["qwen"].revision == SHA
