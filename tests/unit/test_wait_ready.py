"""The readiness gate's program (files/wait_ready.py) against the real vLLM stand-in server on
loopback: it waits out the load delay (/health answers at once, the model is listed later) and
reports the elapsed time; a model that never shows up fails at the timeout with /health's answer
and the journal. systemd cannot run here (no PID 1 systemd): `systemctl show` / `journalctl` are
small TEST DOUBLES on PATH; the testbed runs the gate against real systemd units."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from donorkit.commands.transport import free_port
from donorkit.inventory.paths import REPO_ROOT

GATE = REPO_ROOT / "files/wait_ready.py"
STANDIN = REPO_ROOT / "tests/testbed/standins/vllm-standin"
MODEL = "turboderp/Qwen3.8-27B-exl3"


@pytest.fixture
def fake_systemd(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(
        "#!/bin/sh\n# TEST DOUBLE for `systemctl show`: a running unit, its ExecStart as systemd\n"
        "# shows it.\n"
        'case "$*" in *ExecStart*) echo "ExecStart={ path=/v/bin/vllm ; argv[]=/v/bin/vllm serve '
        f'{MODEL} --max-model-len 4096 --max-num-seqs 12 ; ignore_errors=no ; }}"; exit;; esac\n'
        "printf 'ActiveState=active\\nSubState=running\\nNRestarts=0\\nExecMainPID=42\\n'\n")
    (bin_dir / "journalctl").write_text(
        "#!/bin/sh\n# TEST DOUBLE for journalctl: one line a log reader must see.\n"
        "echo 'vllm-standin: loading (journal test line)'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def serve(port: int, delay: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(STANDIN), "serve", MODEL, "--host", "127.0.0.1",
                             "--port", str(port)], env={**os.environ,
                                                        "VLLM_STANDIN_LOAD_DELAY": str(delay)},
                            stderr=subprocess.DEVNULL)
    return proc


def gate(env, port: int, timeout: float) -> subprocess.CompletedProcess:
    # As the deploy runs it (as root): isolated, no site-packages (tasks/units.py).
    return subprocess.run([sys.executable, "-I", "-S", str(GATE), "--unit", "vllm-qwen.service",
                           "--port", str(port), "--model", MODEL, "--timeout", str(timeout),
                           "--interval", "0.2", "--report-every", "1"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_gate_waits_out_the_load_delay(fake_systemd):
    port = free_port()
    proc = serve(port, 3)
    try:
        began = time.monotonic()
        result = gate(fake_systemd, port, 30)
        took = time.monotonic() - began
    finally:
        proc.terminate()
        proc.wait()
    assert result.returncode == 0, result.stderr
    assert 2.5 < took < 10, took
    assert "not ready after" in result.stdout  # it said it was waiting, with the time
    ready = result.stdout.strip().splitlines()[-1]
    assert ready.startswith("ready gate: vllm-qwen.service ready after "), ready
    assert float(ready.split("after ")[1].split(" s")[0]) >= 2.5


def test_gate_times_out_with_the_journal(fake_systemd):
    port = free_port()
    proc = serve(port, 60)
    try:
        result = gate(fake_systemd, port, 2)
    finally:
        proc.terminate()
        proc.wait()
    assert result.returncode == 1
    assert "not ready after 2 s (timeout); /health: 200, /v1/models lists []" in result.stderr
    assert "journal test line" in result.stderr


def test_standin_refuses_a_bad_flag_as_vllm_does():
    result = subprocess.run([sys.executable, str(STANDIN), "serve", MODEL, "--kv-cache-dtype",
                             "fp9"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp9'" in result.stderr


def test_standin_offline_needs_the_snapshot(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    rev = "4ff9003a33658da90d0bc7977d0251d39075a663"
    result = subprocess.run([sys.executable, str(STANDIN), "serve", MODEL, "--revision", rev,
                             "--port", str(free_port())], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1 and "LocalEntryNotFoundError" in result.stderr


def test_ready_means_the_warm_up_was_answered(fake_systemd):
    """After the model is listed the gate sends a short prompt, a long one and --max-num-seqs
    (12, read from the unit's ExecStart) at once; all answered: ready."""
    port = free_port()
    proc = serve(port, 0)
    try:
        result = gate(fake_systemd, port, 30)
    finally:
        proc.terminate()
        proc.wait()
    assert result.returncode == 0, result.stderr
    assert f"lists {MODEL} after" in result.stdout
    assert result.stdout.strip().splitlines()[-1].endswith(
        f"({MODEL} listed and answered 14 warm-up requests)")


ENGINE_DYING_AT_FIRST_REQUEST = f"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"data": [{{"id": "{MODEL}"}}]}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        self.send_response(500); self.send_header("Content-Length", "14"); self.end_headers()
        self.wfile.write(b"EngineDeadError")
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_listed_model_that_does_not_answer_is_not_ready(fake_systemd, tmp_path):
    """TEST DOUBLE of an engine that lists its model and dies in its first request (as vLLM
    did on the H200 with FlashInfer's GDN prefill at a head dim it lacks): not ready, with why
    and the journal."""
    port = free_port()
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_DYING_AT_FIRST_REQUEST)
    proc = subprocess.Popen([sys.executable, str(script), str(port)], stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        result = gate(fake_systemd, port, 30)
    finally:
        proc.terminate()
        proc.wait()
    assert result.returncode == 1
    assert ("did not become ready: listed, but the warm-up was not answered: 1 of 1 warm-up "
            "request(s) failed: HTTP 500: EngineDeadErr") in result.stderr
    assert "journal test line" in result.stderr
