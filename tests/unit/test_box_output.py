"""What boxes send back is the box owner's (issue 32, hole 5): every answer read within a byte
limit and a deadline for the whole exchange, every field printed or recorded bounded and
escaped. Real servers on loopback stand in for a hostile box: the HTTPS one of the accept tests
(tests/support/version_server.py, our CA's certificate, the client CA required as a donor's Caddy
does) and the SSH one (tests/support/loopback_sshd.py, answering commands as told), sending escape
sequences, huge answers and bytes one at a time."""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
import time
import unicodedata
from datetime import datetime, timezone
from pathlib import Path

import pytest

from donorkit.commands import accept as a
from donorkit.commands import accept_records as core
from donorkit.commands import status, transport
from donorkit.commands.transport import AnswerTooLarge, SshRunner, https_get, shown
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from tests.support import loopback_sshd, version_server

HOSTNAME = "h.example.com"
# What retitles the operator's terminal, clears it, and reverses what follows.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e\x7f"
TOO_MUCH = transport.ANSWER_LIMIT + (1 << 20)


def unsafe(text: str) -> list[str]:
    """The characters of `text` a terminal would act on (control other than a newline, format
    and separator characters)."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in
            {"Cc", "Cf", "Zl", "Zp", "Cs"}]


def strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def test_shown_escapes_and_bounds() -> None:
    assert shown(HOSTILE) == "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202e\\x7f"
    assert shown("a\\x1b") == "a\\\\x1b"  # the box's own backslash is not an escape of ours
    assert shown("caf\u00e9 \u4e2d 4090") == "caf\u00e9 \u4e2d 4090"
    assert shown("x" * 1000, 10) == "x" * 10 + "...(990 more)"
    assert shown("\x1b" * 100, 10) == "\\x1b\\x1b...(98 more)"
    assert shown(None) == "None" and not unsafe(shown("line\nnext\u2028\ufeff"))


# --- HTTPS ------------------------------------------------------------------------------------
def _huge(handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(TOO_MUCH))
    handler.end_headers()
    block = b"x" * (1 << 20)
    for _ in range(TOO_MUCH >> 20):
        handler.wfile.write(block)


def _trickle(handler, seconds: float = 40, head: bool = True) -> None:
    """The answer one byte at a time, for `seconds` (each wait far below any read timeout)."""
    if head:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        handler.wfile.flush()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.2)


def _slow_head(handler) -> None:
    """The status line itself one byte at a time: a deadline per read never ends it."""
    for byte in b"HTTP/1.1 200 OK" + b" " * 200:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.2)


ANSWERS = {"/huge": _huge, "/trickle": _trickle, "/slow-head": _slow_head}


@pytest.fixture
def caddy(tmp_path: Path):
    """A donor's Caddy for HOSTNAME (our CA, the client CA required), answering ANSWERS."""
    pki = Pki(tmp_path / "pki")
    with version_server.serve(pki, "box", HOSTNAME, "0.26.0", tmp_path, client_ca=True,
                              answers=ANSWERS) as server:
        yield server, pki


def _get(server, pki: Pki, path: str, timeout: float = 2) -> tuple[int, str]:
    pair = tuple(str(p) for p in pki.client_pair(OPERATOR_CLIENT))
    return https_get("127.0.0.1", server.port, HOSTNAME, path, pki.directory / "ca.crt",
                     pair, timeout=timeout)


def test_https_answers_are_capped_and_a_trickle_ends_by_the_deadline(caddy) -> None:
    server, pki = caddy
    assert _get(server, pki, "/version") == (200, '{"version": "0.26.0"}')
    with pytest.raises(AnswerTooLarge, match=f"longer than {transport.ANSWER_LIMIT} bytes"):
        _get(server, pki, "/huge", timeout=30)
    for path in ("/trickle", "/slow-head"):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no whole answer within 2 s"):
            _get(server, pki, path)
        assert time.monotonic() - started < 5, path


# --- SSH --------------------------------------------------------------------------------------
def _box(tmp_path: Path, sshd: loopback_sshd.LoopbackSshd, caddy_port: int) -> Path:
    path = tmp_path / "donors.yml"
    path.write_text(textwrap.dedent(f"""\
        overrides: {{pki_dir: {tmp_path / 'pki'}, caddy_https_port: {caddy_port}}}
        donors:
          a: {{ssh_host: 127.0.0.1, ssh_port: {sshd.port}, ssh_user: root,
              ssh_key: {sshd.client_key}, ssh_known_hosts_file: {sshd.known_hosts},
              card: rtx4090, routes: {{{HOSTNAME}: qwen}}}}
        """))
    return path


def _sshd(tmp_path: Path, reply):
    (tmp_path / "sshd").mkdir(exist_ok=True)
    return loopback_sshd.serve(tmp_path / "sshd", exec_reply=reply)


def _flood(command: str, channel) -> None:
    block = b"y" * (1 << 20)
    for _ in range(TOO_MUCH >> 20):
        channel.sendall(block)


def _drip(command: str, channel) -> None:
    channel.sendall(b"== gpu\n")
    end = time.monotonic() + 40
    while time.monotonic() < end and not channel.closed:
        channel.sendall(b"x")
        time.sleep(0.2)


def test_ssh_output_is_capped_and_a_trickle_ends_by_the_deadline(tmp_path: Path) -> None:
    for reply, error, match in ((_flood, AnswerTooLarge, "longer than"),
                                (_drip, TimeoutError, "no whole answer within 2 s")):
        with _sshd(tmp_path, reply) as sshd:
            data = load_inventory(_box(tmp_path, sshd, 443))[0]["a"]
            runner = SshRunner(data, timeout=5)
            started = time.monotonic()
            try:
                with pytest.raises(error, match=match):
                    runner.run("status", timeout=2)
            finally:
                runner.close()
            assert time.monotonic() - started < (5 if reply is _drip else 30)


# --- make status ------------------------------------------------------------------------------
def _hostile_status(unit: str):
    def reply(command: str, channel) -> None:
        channel.sendall(textwrap.dedent(f"""\
            == gpu
            NVIDIA {HOSTILE}{'X' * 5000}, 580{HOSTILE}, 1024, 24564, 7
            == uptime
            100.0
            == unit {unit}
            ActiveState=active{HOSTILE}
            SubState=running
            ActiveEnterTimestampMonotonic=1000000
            ExecStart={{ argv[]=/v/bin/vllm serve m --revision {'a' * 40}{HOSTILE} ; }}
            == drained
            no
            == toolkit
            0.15.0{HOSTILE}
            == dists
            vllm-0.26.0{HOSTILE}.dist-info
            """).encode())
    return reply


def _models(handler) -> None:
    body = json.dumps({"data": [{"id": f"evil{HOSTILE}" + "Y" * 3000}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_status_shows_a_hostile_boxs_fields_escaped_and_bounded(tmp_path: Path,
                                                                capsys) -> None:
    pki = Pki(tmp_path / "pki")
    with version_server.serve(pki, "a", HOSTNAME, "0.26.0", tmp_path, client_ca=True,
                              answers={"/v1/models": _models}) as caddy:
        unit = "vllm-qwen.service"
        with _sshd(tmp_path, _hostile_status(unit)) as sshd:
            path = _box(tmp_path, sshd, caddy.port)
            assert load_inventory(path)[0]["a"].models["qwen"].unit == unit
            assert status.main(["--donors", str(path), "--timeout", "5"]) == 1
            table = capsys.readouterr().out
            assert status.main(["--donors", str(path), "--timeout", "5", "--json"]) == 1
            doc = json.loads(capsys.readouterr().out)
    assert not unsafe(table), table
    assert "\\x1b]0;pwned\\x07" in table and "\\u202e" in table
    assert max(map(len, table.splitlines())) < 1500
    row = doc["hosts"][0]
    assert not [s for s in strings(doc) if unsafe(s)], doc
    assert row["gpu"]["card"].startswith("NVIDIA \\x1b]0;pwned") and len(row["gpu"]["card"]) < 90
    assert row["models"][0]["state"].startswith("active\\x1b")
    assert row["models"][0]["revision"].startswith("a" * 40 + "\\x1b")
    assert row["toolkit"].startswith("0.15.0\\x1b") and row["vllm"].startswith("0.26.0\\x1b")
    problem = row["models"][0]["problem"]
    assert problem.startswith("turboderp/") and "evil\\x1b]0;pwned" in problem
    assert len(problem) < 250


def test_status_leaves_a_trickling_box_behind_by_the_deadline(tmp_path: Path,
                                                              capsys) -> None:
    """A box that answers its status command a byte at a time: its row is a timeout by the
    deadline, and the command returns (before: the probe read on, and collect() waited for it
    after reporting it timed out)."""
    with _sshd(tmp_path, _drip) as sshd:
        path = _box(tmp_path, sshd, 443)
        done: list[int] = []
        started = time.monotonic()
        thread = threading.Thread(target=lambda: done.append(
            status.main(["--donors", str(path), "--timeout", "2"])), daemon=True)
        thread.start()
        thread.join(25)
        assert done == [1], "make status still waiting on a trickling box"
        assert time.monotonic() - started < 10
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("a: UNREACHABLE") and "no whole answer within 2 s" in line, line


def test_collect_does_not_wait_for_a_probe_it_reported_timed_out(monkeypatch) -> None:
    """Whatever holds a probe past every timeout, the row says so at the run's deadline and
    nothing waits for that probe afterwards (not even the interpreter's exit: a daemon)."""
    stuck = threading.Event()
    monkeypatch.setattr(status, "probe_donor", lambda *_: stuck.wait() or {})
    fleet, _ = load_inventory(Path(__file__).resolve().parents[2] / "inventory/donors.yml")
    fleet = dict(list(fleet.items())[:1])
    done: list[list[dict]] = []
    thread = threading.Thread(target=lambda: done.append(status.collect(fleet, {}, 0.25)),
                              daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(20)
    stuck.set()
    assert done, "collect() waited for the probe it reported timed out"
    assert time.monotonic() - started < 5
    [row] = done[0]
    assert "TimeoutError: no answer within 2 s: left behind" in row["unreachable"]


# --- make accept ------------------------------------------------------------------------------
def _target(base_url: str, ca: Path, client: tuple[str, str] | None, seconds: float = 2):
    workload = core.Workload(decode_max_tokens=8, prefill_prompt_tokens=100,
                             concurrent_prompts=2, concurrent_prompt_tokens=50,
                             concurrent_max_tokens=4, request_timeout_s=seconds)
    return core.Target(donor="a", card="rtx4090", model="qwen", checkpoint="o/m",
                       max_model_len=4096, hostname=HOSTNAME, base_url=base_url,
                       ca_file=str(ca), workload=workload,
                       card_acceptance=core.CardAcceptance(), tolerance=0.15, client=client)


async def _read(target, path: str) -> int:
    client, http = a._client(target)
    async with client:
        return len((await http.get(f"{target.base_url}{path}")).content)


def test_accepts_client_caps_answers_and_ends_a_trickle_by_the_deadline(caddy) -> None:
    server, pki = caddy
    pair = tuple(str(p) for p in pki.client_pair(OPERATOR_CLIENT))
    target = _target(server.base_url, pki.directory / "ca.crt", pair)
    assert asyncio.run(_read(target, "/version")) == len('{"version": "0.26.0"}')
    with pytest.raises(AnswerTooLarge, match=f"longer than {transport.ANSWER_LIMIT} bytes"):
        asyncio.run(_read(_target(server.base_url, pki.directory / "ca.crt", pair, 30),
                          "/huge"))
    for path in ("/trickle", "/slow-head"):
        started = time.monotonic()
        with pytest.raises(Exception, match="no whole answer within 2 s|timed out"):
            asyncio.run(_read(target, path))
        assert time.monotonic() - started < 5, path


def test_accept_records_and_prints_a_hostile_version_escaped(tmp_path: Path) -> None:
    """The vLLM stand-in answering /version with escape sequences: the record and the summary
    hold them escaped."""
    from tests.unit.test_accept import measure_standin

    out = measure_standin({"VLLM_STANDIN_VERSION": HOSTILE + "v" * 500})
    version = out["details"]["version"]["version"]
    assert version.startswith("\\x1b]0;pwned") and not unsafe(version) and len(version) < 90
    res = core.ModelResults.model_validate({**out, "elapsed_s": 1.0})
    record = core.new_record(_target("http://x", tmp_path, None), datetime.now(timezone.utc))
    record.results["qwen"] = res
    assert not unsafe(core.summary_table([record]))


# --- copy-backs -------------------------------------------------------------------------------
def test_a_copy_back_past_its_limit_is_refused_and_removed(tmp_path: Path, caplog) -> None:
    """The kernel and wheel caches' copy-backs (wheel_cache.CappedDownload) through a real
    pyinfra host (@local: pyinfra's local connector copies as the SSH one downloads, into the
    same writer): a file within the limit is copied whole; one past it is refused with one
    line, the partial copy removed, the host failed (False), no exception."""
    from pyinfra.api import Config, Inventory, State

    from donorkit.box import wheel_cache

    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    host = inventory.get_host("@local")
    host.connect()
    small, big = tmp_path / "sidecar", tmp_path / "archive"
    small.write_text("a" * 64 + "  kernels.tar\n")
    big.write_bytes(b"k" * (3 << 20))
    got = tmp_path / "got"
    assert wheel_cache.CappedDownload(str(small), str(got), 4096).execute(state, host, {})
    assert got.read_text() == small.read_text()
    caplog.clear()
    command = wheel_cache.CappedDownload(str(big), str(got), 1 << 20)
    assert repr(command) == f"FileDownloadCommand({big}, {got}, at most 1048576 bytes)"
    assert command.execute(state, host, {}) is False
    assert not got.exists()
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.endswith(f"{big}: more than 1048576 bytes: not copied back"), line
