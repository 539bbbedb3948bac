"""The testbed's HTTP server (10.213.0.1:8089 only; its CDN side on :8090), with the stand-in
Hugging Face Hub (hub_standin.py), and the stand-in exllamav3 git repository."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from donorkit.commands.transport import wait_until

from . import tiny_model
from .common import REPO_ROOT, STANDINS, WORK, find_pids, log, run
from .hub_standin import generate_checkpoint
from .network import GATEWAY

WWW = WORK / "www"
PORT = 8089
CDN_PORT = 8090
URL = f"http://{GATEWAY}:{PORT}"
# The stand-in hub's repositories (<org>/<name>/ folders): the generated checkpoint the testbed's
# qwen model is fetched as (its fixed revision: tests/testbed/donors.yml), and the tiny real
# model the real-engine host serves (tiny_model.MODEL_ID; its revision: donors-cpu.yml).
HUB = WORK / "hub"
HUB_CHECKPOINT = "turboderp/Qwen3.8-27B-exl3"
EXLLAMAV3_TAG = "v1.5.1"
GIT_URL = f"{URL}/exllamav3.git"
# Fixed identity and dates: the stand-in's commit (and tag) hash is the same on every run.
_GIT_ENV = {"GIT_AUTHOR_NAME": "uncloseai testbed", "GIT_AUTHOR_EMAIL": "testbed@invalid",
            "GIT_COMMITTER_NAME": "uncloseai testbed", "GIT_COMMITTER_EMAIL": "testbed@invalid",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


def build_git_repo(www: Path = WWW) -> Path:
    """STAND-IN for github.com/turboderp-org/exllamav3: committed source, tag v1.5.1, dumb HTTP."""
    bare = www / "exllamav3.git"
    shutil.rmtree(bare, ignore_errors=True)
    env = {**os.environ, **_GIT_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "exllamav3"
        shutil.copytree(STANDINS / "exllamav3", work,
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "*.so"))
        git = ["git", "-C", work]
        run([*git, "init", "-q", "-b", "master"], env=env)
        run([*git, "add", "."], env=env)
        run([*git, "commit", "-q", "-m", "exllamav3 1.5.1 (testbed stand-in)"], env=env)
        run([*git, "tag", "-a", EXLLAMAV3_TAG, "-m", f"exllamav3 {EXLLAMAV3_TAG}"], env=env)
        run(["git", "clone", "-q", "--bare", work, bare], env=env)
    # Dumb HTTP: a static file server is enough once info/refs and objects/info/packs exist.
    run(["git", "-C", bare, "update-server-info"], env=env)
    return bare


def start_http(www: Path = WWW, hub: Path = HUB) -> int:
    """Serve www/ and the hub stand-in on the bridge address only (the hosts see it, nothing
    else). Returns its pid."""
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    generate_checkpoint(hub / HUB_CHECKPOINT)
    tiny_model.write(hub / tiny_model.MODEL_ID)
    out = open(logs / "http.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hub_standin", "--bind", GATEWAY,
                             "--port", str(PORT), "--cdn-port", str(CDN_PORT),
                             "--directory", str(www), "--hub-root", str(hub)],
                            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def listening() -> str | None:
        if proc.poll() is not None:
            raise RuntimeError(f"http.server exited {proc.returncode}; see {logs / 'http.log'}")
        try:
            socket.create_connection((GATEWAY, PORT), timeout=1).close()
        except OSError as exc:
            return f"http.server did not listen on {GATEWAY}:{PORT} ({exc})"
        return None

    why = wait_until(listening, 10, 0.1)
    if why:
        raise RuntimeError(why)
    return proc.pid


def is_http(cmdline: list[str]) -> bool:
    """Our server's command line: the hub stand-in (or an older run's http.server) serving
    exactly .testbed/www."""
    return ("tests.support.hub_standin" in cmdline or "http.server" in cmdline) and \
        str(WWW) in cmdline


def stop_http(pid: int | None) -> None:
    """Stop our server: the pid from the state file, or any process serving .testbed/www."""
    pids = {p for p in find_pids(is_http)}
    if pid and pid in pids:
        pids = {pid} | pids
    for p in pids:
        log(f"stopping http.server {p}")
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _ in range(50):
            if not Path(f"/proc/{p}").exists() or _zombie_reaped(p):
                break
            time.sleep(0.1)


def _zombie_reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False
