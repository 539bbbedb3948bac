"""The edge's canary (files/edge_canary.py, issue 35): its state transitions (out after
`fail_after` fails in a row, back after `pass_after` passes, a wrong model id out at once,
unjudged without a reference, no answer counting neither way); the Caddy filter on the real
`caddy adapt` output of the rendered edge Caddyfile; the units and caddy.service's drop-in with
systemd-analyze; `donors reference` refusals, one line each; and end to end on this machine's
loopback with real Caddy 2.6.2 (bench/edge_failover.py's setup: two donor Caddies, each in front
of the vLLM STAND-IN, and the edge's): a reference recorded from donor A's Caddy, donor B switched
to another checkpoint taken out of the edge's pool through the admin API and brought back, with a
request loop through the edge that loses nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render.canary_files import (
    CANARY_DROP_IN,
    CANARY_SERVICE,
    CANARY_TIMER,
    canary_config,
    load_reference,
    member_reference,
    reference_path,
    render_canary,
)
from donorkit.render.templates import render_edge
from tests.unit.test_edge import (
    CADDIES,
    CADDY_IDS,
    FLEET,
    caddy_or_skip,
    handlers,
    in_tmp,
    lay_out,
    load,
    run_caddy,
    sites,
)

DISTRO_CADDY = "/usr/bin/caddy"
TESTBED = REPO_ROOT / "tests/testbed/donors.yml"
STANDIN = REPO_ROOT / "tests/testbed/standins/vllm-standin"
DONORS = Path(sys.executable).parent / "donors"

spec = importlib.util.spec_from_file_location("edge_canary", REPO_ROOT / "files/edge_canary.py")
edge_canary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(edge_canary)
canary = edge_canary.canary

KNOBS = {"fail_after": 2, "pass_after": 3, "window": 4, "min_agree": 0.75,
         "max_logprob_gap": 0.5}


def member(reference: str | None = "rtx4090") -> dict:
    return {"hostname": "h.example", "donor": "b", "address": "192.0.2.12:443",
            "verdict": "in", "reference": reference}


def outcome(result: str, why: str | None = None) -> dict:
    evidence = ({"agree": 0.1, "gap": 1.2, "matched": 1, "total": 8,
                 "first_difference": "prompt 0 token 1: ' Paris' expected, ' cold' answered"}
                if result == "fail" else None)
    return {"result": result, "why": why or result, **({"evidence": evidence} if evidence else {})}


# ------------------------------------------------------------------ state transitions -------
def test_out_after_fail_after_fails_in_a_row_back_after_pass_after_passes() -> None:
    m = member()
    assert edge_canary.update(m, outcome("fail"), KNOBS, 1) is None
    assert m["verdict"] == "in" and m["fails"] == 1
    assert edge_canary.update(m, outcome("pass"), KNOBS, 2) is None   # the run is broken
    assert edge_canary.update(m, outcome("fail"), KNOBS, 3) is None
    line = edge_canary.update(m, outcome("fail"), KNOBS, 4)
    assert m["verdict"] == "out" and line.startswith("OUT: b (192.0.2.12:443) for h.example")
    # The evidence is in the journal's line: the score and the first differing token.
    assert "agree 0.1, gap 1.2" in line and "' Paris' expected" in line, line
    assert m["last_failure"]["evidence"]["matched"] == 1
    for now in (5, 6):
        assert edge_canary.update(m, outcome("pass"), KNOBS, now) is None
        assert m["verdict"] == "out"
    assert edge_canary.update(m, outcome("fail"), KNOBS, 7) is None    # passes start over
    for now in (8, 9):
        edge_canary.update(m, outcome("pass"), KNOBS, now)
    assert m["verdict"] == "out"
    line = edge_canary.update(m, outcome("pass"), KNOBS, 10)
    assert m["verdict"] == "in" and line.startswith("BACK IN: b"), line
    # The pass rate is over the last `window` rounds only.
    assert len(m["history"]) == KNOBS["window"] and m["pass_rate"] == 0.75


def test_a_wrong_model_id_is_out_at_once_even_unjudged() -> None:
    for reference in ("rtx4090", None):
        m = member(reference)
        line = edge_canary.update(m, outcome("mismatch", "answered as model 'x/y'"), KNOBS, 1)
        assert m["verdict"] == "out" and "answered as model 'x/y'" in line
        # Back after pass_after good rounds: in, or unjudged again without a reference.
        for now in range(2, 2 + KNOBS["pass_after"]):
            line = edge_canary.update(m, outcome("pass" if reference else "unjudged"), KNOBS,
                                      now)
        assert m["verdict"] == ("in" if reference else "unjudged") and "BACK IN" in line


def test_unjudged_stays_in_and_no_answer_counts_neither_way() -> None:
    m = member(None)
    line = edge_canary.update(m, outcome("unjudged", "no reference"), KNOBS, 1)
    assert m["verdict"] == "unjudged" and line.startswith("UNJUDGED: b")
    assert "pass_rate" not in m                     # nothing judged, no rate
    m = member()
    edge_canary.update(m, outcome("fail"), KNOBS, 1)
    for now in range(2, 10):                        # a donor restarting: refused, timed out
        assert edge_canary.update(m, outcome("no_answer", "ConnectionRefusedError"), KNOBS,
                                  now) is None
    assert m["verdict"] == "in" and m["fails"] == 1 and m["last_error"]


def standin(tmp_path: Path, port: int, *extra: str, env: dict | None = None):
    proc = subprocess.Popen([sys.executable, str(STANDIN), "serve", "org/model", "--revision",
                             "r1", "--host", "127.0.0.1", "--port", str(port), *extra],
                            env={**os.environ, "VLLM_STANDIN_ANSWER_AS_FILE":
                                 str(tmp_path / f"as-{port}"), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


def plain_post(port: int):
    """check_member's transport, as plain HTTP to a stand-in's port (no Caddy in between)."""
    import http.client

    def post(address, hostname, body, context, timeout):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            connection.request("POST", "/v1/completions", body=body,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()
    return post


def test_check_member_against_the_standin(tmp_path: Path) -> None:
    """The stand-in's answers, real HTTP: the same checkpoint and revision pass; another
    checkpoint (answer-as file) fails with the first differing token; another model id is a
    mismatch; another revision fails; no reference is unjudged."""
    from donorkit.commands.transport import free_port

    ports = [free_port(), free_port()]
    procs = [standin(tmp_path, ports[0]),
             standin(tmp_path, ports[1], env={"VLLM_STANDIN_MODEL_ID": "other/model"})]
    try:
        site = {"hostname": "h.example", "checkpoint": "org/model"}
        bare = {"donor": "a", "address": "127.0.0.1:1"}
        config = {**KNOBS, "timeout": 10}
        got = edge_canary.check_member(config, site, bare, None, plain_post(ports[0]))
        assert got["result"] == "unjudged"
        # The reference: the stand-in's own answers, as `donors reference` records them.
        prompts = []
        for prompt in canary.PROMPTS:
            raw = plain_post(ports[0])(None, None, canary.request_body("org/model", prompt),
                                       None, 10)[1]
            answer = canary.parse_answer(raw)
            prompts.append({"prompt": prompt, "tokens": list(answer.tokens),
                            "logprobs": list(answer.logprobs)})
        upstream = {**bare, "reference": {"stack": "s", "max_tokens": canary.MAX_TOKENS,
                                          "prompts": prompts}}
        got = edge_canary.check_member(config, site, upstream, None, plain_post(ports[0]))
        assert got["result"] == "pass" and got["evidence"]["agree"] == 1.0, got
        for answer_as in ("other/checkpoint", "org/model@r2"):
            (tmp_path / f"as-{ports[0]}").write_text(answer_as + "\n")
            got = edge_canary.check_member(config, site, upstream, None, plain_post(ports[0]))
            assert got["result"] == "fail", got
            assert "expected" in got["evidence"]["first_difference"], got
        (tmp_path / f"as-{ports[0]}").write_text("")
        got = edge_canary.check_member(config, site, upstream, None, plain_post(ports[1]))
        assert got["result"] == "mismatch" and "'other/model'" in got["why"], got
        got = edge_canary.check_member(config, site, upstream, None, plain_post(free_port()))
        assert got["result"] == "no_answer", got
        # A donor that does not serve the route's checkpoint at all: vLLM's 404 is a failure.
        got = edge_canary.check_member(config, {**site, "checkpoint": "org/else"}, upstream,
                                       None, plain_post(ports[0]))
        assert got == {"result": "fail", "why": "HTTP 404 to a completion"}, got
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def tls_server(tmp_path: Path, answer) -> tuple[int, object, threading.Event]:
    """A TLS server for h.example on loopback (a certificate of a throwaway CA): `answer(tls,
    request)` answers its one connection. (port, client context, stop event)"""
    import socket
    import ssl

    from donorkit.inventory.pki import Pki

    pki = Pki(tmp_path / "pki")
    cert, key = pki.server_cert("donor", ["h.example"])
    (tmp_path / "s.crt").write_text(cert)
    (tmp_path / "s.key").write_text(key)
    (tmp_path / "ca.crt").write_text(pki.ca_pem())
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "s.crt", tmp_path / "s.key")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            request = tls.recv(65536)
            try:
                answer(tls, request, stop)
            except OSError:
                pass
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return (listener.getsockname()[1],
            ssl.create_default_context(cafile=str(tmp_path / "ca.crt")), stop)


def test_a_dripping_donor_is_cut_at_the_timeout(tmp_path: Path) -> None:
    """A donor that answers one byte at a time: post_completion gives up at `timeout` for the
    whole exchange (a round cannot be held for hours by a donor slow on purpose)."""
    def drip(tls, request, stop) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.is_set():
            tls.sendall(b"x")
            time.sleep(0.2)

    port, context, stop = tls_server(tmp_path, drip)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            edge_canary.post_completion(f"127.0.0.1:{port}", "h.example", b"{}", context, 2)
        assert time.monotonic() - started < 4
    finally:
        stop.set()


def test_the_canary_looks_like_a_client_and_a_gzip_answer_is_read_bounded(
        tmp_path: Path) -> None:
    """The request carries what a client's carries through the edge (no marker of its own); a
    gzip answer is unpacked, at most the answer limit + 1 byte of it (a bomb is cut there)."""
    import gzip

    seen: list[bytes] = []
    bomb = gzip.compress(b"0" * (64 << 20))

    def gzipped(tls, request, stop) -> None:
        seen.append(request)
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: "
                    + str(len(bomb)).encode() + b"\r\nConnection: close\r\n\r\n" + bomb)

    port, context, _ = tls_server(tmp_path, gzipped)
    status, raw = edge_canary.post_completion(f"127.0.0.1:{port}", "h.example",
                                              canary.request_body("o/m", "p"), context, 10)
    assert status == 200 and len(raw) == canary.ANSWER_LIMIT + 1
    with pytest.raises(canary.BadAnswer, match="answer over"):
        canary.parse_answer(raw)
    head = seen[0].split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("POST /v1/completions HTTP/1.1\r\n") and "Host: h.example" in head
    for line in ("Accept-Encoding: gzip", "Connection: close", "X-Forwarded-Proto: https",
                 "X-Forwarded-Host: h.example", "User-Agent: OpenAI/Python"):
        assert line in head, head
    assert "canary" not in head.lower()


# ------------------------------------------------------------------ Caddy's config ----------
@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_the_filter_on_real_caddy_adapt_output(tmp_path: Path, binary: str) -> None:
    """The rendered edge Caddyfile adapted by Caddy (the distro's 2.6.2; 2.11.7): one out
    member leaves only its own site's pool, the rest as it was; every member of a site out:
    that site answers 502; the filtered JSON is a config Caddy validates."""
    _, edges = load(tmp_path, FLEET)
    edge = in_tmp(edges["front"], tmp_path)
    caddyfile = lay_out(render_edge(edge), tmp_path)
    binary = caddy_or_skip(binary)
    adapted = run_caddy(binary, "adapt", caddyfile)
    assert adapted.returncode == 0, adapted.stderr
    config = json.loads(adapted.stdout)
    filtered = edge_canary.filtered_config(json.loads(adapted.stdout),
                                           {("hermes.ai.unturf.com", "192.0.2.12:443")})

    def dials(conf: dict) -> dict[str, list[str]]:
        return {host: [u["dial"] for h in handlers(route, "reverse_proxy")
                       for u in h["upstreams"]] for host, route in sites(conf).items()}

    assert dials(config)["hermes.ai.unturf.com"] == ["192.0.2.11:443", "192.0.2.12:443"]
    assert dials(filtered) == {**dials(config), "hermes.ai.unturf.com": ["192.0.2.11:443"]}
    # b is out of hermes only: qwen.ai.unturf.com keeps it.
    assert dials(filtered)["qwen.ai.unturf.com"] == ["192.0.2.12:443"]
    none_left = edge_canary.filtered_config(json.loads(adapted.stdout), {
        ("hermes.ai.unturf.com", "192.0.2.11:443"), ("hermes.ai.unturf.com", "192.0.2.12:443")})
    route = sites(none_left)["hermes.ai.unturf.com"]
    assert not handlers(route, "reverse_proxy")
    assert [h["status_code"] for h in handlers(route, "static_response")].count(502) == 1
    for name, conf in (("one-out", filtered), ("all-out", none_left)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(conf))
        result = subprocess.run([binary, "validate", "--config", str(path)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ units -------------------
def edge_files(tmp_path: Path) -> dict[str, str]:
    _, edges = load_inventory(TESTBED)
    edge = edges["tb-edge"].model_copy(update={"pki_dir": str(tmp_path / "pki")})
    return {f.path: f.content for f in render_canary(edge)}


def test_the_units_and_the_drop_in_pass_systemd_analyze(tmp_path: Path) -> None:
    files = edge_files(tmp_path)
    units = tmp_path / "units"
    (units / "caddy.service.d").mkdir(parents=True)
    for name in (CANARY_SERVICE, CANARY_TIMER):
        (units / name).write_text(files[f"/etc/systemd/system/{name}"])
    (units / "caddy.service.d/uncloseai-canary.conf").write_text(files[CANARY_DROP_IN])
    # The distro's caddy.service, as Debian 12 ships it, with the drop-in beside it.
    (units / "caddy.service").write_text(Path("/usr/lib/systemd/system/caddy.service").read_text()
                                         if Path("/usr/lib/systemd/system/caddy.service").exists()
                                         else "[Service]\nType=notify\nUser=caddy\nExecStart="
                                              "/usr/bin/caddy run\nExecReload=/usr/bin/caddy "
                                              "reload\n")
    for name in (CANARY_SERVICE, CANARY_TIMER, "caddy.service"):
        result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(units / name)],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"})
        said = result.stdout + result.stderr
        assert result.returncode == 0 and str(units) not in said, said
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                             str(units / CANARY_SERVICE)], capture_output=True, text=True,
                            timeout=60)
    exposure = float(result.stdout.rsplit("Overall exposure level for", 1)[1].split(":")[1]
                     .split()[0])
    assert exposure <= 2.0, result.stdout
    drop_in = files[CANARY_DROP_IN]
    # The distro's reload is reset, then replaced by the filter; the start applies it too.
    assert "ExecReload=\nExecReload=/usr/bin/python3 -I -S /opt/uncloseai/canary/edge_canary.py" \
           " apply /etc/uncloseai/canary/canary.json" in drop_in
    assert "ExecStartPost=-/usr/bin/python3 -I -S" in drop_in
    service = files[f"/etc/systemd/system/{CANARY_SERVICE}"]
    assert "User=caddy\n" in service and "StateDirectory=uncloseai-canary\n" in service
    assert "OnUnitInactiveSec=5000ms" in files[f"/etc/systemd/system/{CANARY_TIMER}"]


def test_the_runner_runs_under_isolated_system_python(tmp_path: Path) -> None:
    """`python3 -I -S`: no site, no script folder on the path: canary.py is found beside it."""
    files = edge_files(tmp_path)
    for path, content in files.items():
        if path.endswith(".py"):
            (tmp_path / Path(path).name).write_text(content)
    result = subprocess.run(["/usr/bin/python3", "-I", "-S", str(tmp_path / "edge_canary.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: edge_canary.py run|apply CONFIG" in result.stderr


# ------------------------------------------------------------------ references --------------
def donors_cli(tmp_path: Path, doc: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k not in ("DONORS_FILE", "DONORS_FLEET")}
    return subprocess.run([str(DONORS), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env={**env, "DONORS_FILE": str(path)})


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, \
        result.stderr
    return lines[0]


def fleet(tmp_path: Path) -> dict:
    doc = yaml.safe_load(TESTBED.read_text())
    doc["overrides"]["pki_dir"] = str(tmp_path / "pki")
    return doc


def test_reference_refusals_one_line_each(tmp_path: Path) -> None:
    doc = fleet(tmp_path)
    said = one_line(donors_cli(tmp_path, doc, "reference", "--limit", "tb-3090"))
    assert "donor 'tb-3090': field 'cache_builder': not a box the operator trusts" in said
    doc["donors"]["tb-4090"]["owner"] = "volunteer"
    doc["donors"]["tb-4090"].pop("cache_builder")
    said = one_line(donors_cli(tmp_path, doc, "reference", "--limit", "tb-4090"))
    assert "donor 'tb-4090': field 'cache_builder'" in said and "owner: volunteer" in said
    doc = fleet(tmp_path)
    doc["overrides"]["models"]["qwen"]["revision"] = None
    said = one_line(donors_cli(tmp_path, doc, "reference", "--limit", "tb-4090"))
    assert "donor 'tb-4090': field 'models.qwen.revision'" in said and "not pinned" in said, said


def test_a_broken_reference_file_is_one_line(tmp_path: Path) -> None:
    from donorkit.render.canary_files import ReferenceError

    path = reference_path(tmp_path, "org/model", "r1", "s")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"checkpoint": "org/model", "revision": "r1", "max_tokens": 8,
                                "prompts": [{"prompt": "p", "tokens": ["a"],
                                             "logprobs": [0.5]}]}))
    with pytest.raises(ReferenceError, match=r"field 'prompts\[0\]'"):
        member_reference(tmp_path, "org/model", "r1", "s")
    assert member_reference(tmp_path, "org/model", "r2", "s") is None    # none: unjudged
    assert member_reference(tmp_path, "org/model", None, "s") is None


# ------------------------------------------------------------------ end to end, loopback ----
@pytest.mark.skipif(not Path(DISTRO_CADDY).exists(), reason="the distro's caddy (2.6.2)")
def test_a_wrong_donor_leaves_the_edge_and_comes_back_losing_no_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from bench import edge_failover
    from donorkit.commands import reference
    from donorkit.commands.transport import free_port
    from donorkit.render.templates import edge_paths

    for name, value in (("EDGE_PORT", free_port()), ("DONOR_PORTS", (free_port(), free_port())),
                        ("MODEL_PORTS", (free_port(), free_port()))):
        monkeypatch.setattr(edge_failover, name, value)
    answer_as = tmp_path / "answer-as-B"
    revision = load_inventory(TESTBED)[0]["tb-4090"].models["qwen"].revision

    class Loopback(edge_failover.Bench):
        def model(self, i: int) -> list[str]:
            # The units' --revision, and donor B's answer-as switch.
            return ["env", f"VLLM_STANDIN_ANSWER_AS_FILE={answer_as if i else tmp_path / 'no'}",
                    *super().model(i), "--revision", revision]

    bench = Loopback(tmp_path, DISTRO_CADDY, DISTRO_CADDY)
    donors, edges = load_inventory(TESTBED)
    ports = edge_failover.DONOR_PORTS
    bench.up()
    try:
        # The reference, recorded from donor A's Caddy with the operator's client certificate.
        a = donors["tb-4090"].model_copy(update=dict(
            ssh_hostname="127.0.0.1", caddy_https_port=ports[0], pki_dir=str(tmp_path / "pki"),
            canary=donors["tb-4090"].canary.model_copy(
                update={"references_dir": str(tmp_path / "references")})))
        assert reference.run({"tb-4090": a}, limited=True, timeout=30) == 0
        path = reference_path(tmp_path / "references", "turboderp/Qwen3.8-27B-exl3", revision,
                              a.canary_stack("qwen"))
        ref = load_reference(path, "turboderp/Qwen3.8-27B-exl3", revision)
        assert json.loads(path.read_text())["built_by"] == "tb-4090"
        edge = edges["tb-edge"]
        tls = edge_paths(edge.model_copy(update={"caddy_tls_dir": str(tmp_path / "edge/tls")}))
        (tmp_path / "state").mkdir()
        config = {
            **KNOBS, "timeout": 10, "caddy": DISTRO_CADDY, "caddyfile": str(bench.edge_file),
            "admin_socket": str(tmp_path / "edge/admin.sock"), "state_dir": str(tmp_path / "state"),
            "ca": tls["ca"], "client_cert": tls["client_cert"], "client_key": tls["client_key"],
            "sites": [{"hostname": edge_failover.HOSTNAME,
                       "checkpoint": "turboderp/Qwen3.8-27B-exl3", "upstreams": [
                           {"donor": key, "address": f"127.0.0.1:{port}", "revision": revision,
                            "reference": ref} for key, port in zip("AB", ports, strict=True)]}]}
        state = edge_canary.run_round(config)
        assert {m["verdict"] for m in state["members"].values()} == {"in"}, state

        results: list = []
        done = threading.Event()

        def loop() -> None:
            seq = 0
            while not done.is_set():
                results.append((time.time(), bench.get(f"canary{os.getpid()}-{seq}")))
                seq += 1
                time.sleep(0.05)

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            time.sleep(1)
            answer_as.write_text("other/checkpoint\n")     # B now serves another model
            state = edge_canary.run_round(config)
            assert state["members"][f"{edge_failover.HOSTNAME} B"]["verdict"] == "in"
            # Slow requests in flight on both donors while B is taken out: all answered.
            import http.client

            from donorkit.commands.transport import https_get

            slow: list = []

            def slow_one(n: int) -> None:
                try:
                    slow.append(https_get("127.0.0.1", edge_failover.EDGE_PORT,
                                          edge_failover.HOSTNAME, "/v1/models", bench.ca,
                                          timeout=30, headers={"X-Standin-Delay": "2"})[0])
                except (OSError, http.client.HTTPException) as exc:
                    slow.append(repr(exc))

            slow_threads = [threading.Thread(target=slow_one, args=(n,)) for n in range(4)]
            for t in slow_threads:
                t.start()
            time.sleep(0.5)
            # fail_after: 2. This round as the timer's service runs it: the system's
            # `python3 -I -S`, the runner and canary.py side by side, the config a file.
            runner = {f.path.rsplit("/", 1)[1]: f.content for f in render_canary(
                edges["tb-edge"].model_copy(update={"pki_dir": str(tmp_path / "pki")}))
                if f.path.endswith(".py")}
            (tmp_path / "runner").mkdir()
            for name, content in runner.items():
                (tmp_path / "runner" / name).write_text(content)
            (tmp_path / "canary.json").write_text(json.dumps(config))
            command = ["/usr/bin/python3", "-I", "-S", str(tmp_path / "runner/edge_canary.py")]
            ran = subprocess.run([*command, "run", str(tmp_path / "canary.json")],
                                 capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0 and "OUT: B" in ran.stdout, ran.stdout + ran.stderr
            assert "caddy: config loaded" in ran.stdout and "without 127.0.0.1" in ran.stdout
            for t in slow_threads:
                t.join()
            assert slow == [200] * 4, slow
            state = edge_canary.load_state(config["state_dir"])
            b = state["members"][f"{edge_failover.HOSTNAME} B"]
            assert b["verdict"] == "out", b
            assert "expected" in b["last_failure"]["evidence"]["first_difference"]
            out_at = time.time()
            # A reload (what `systemctl reload caddy` runs now) keeps B out.
            ran = subprocess.run([*command, "apply", str(tmp_path / "canary.json")],
                                 capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0 and "without 127.0.0.1" in ran.stdout, ran.stderr
            time.sleep(3)
            answer_as.write_text("")                      # fixed
            for _ in range(KNOBS["pass_after"]):
                last_round = time.time()    # B is back during the last round (Caddy's load)
                state = edge_canary.run_round(config)
            assert state["members"][f"{edge_failover.HOSTNAME} B"]["verdict"] == "in", state
            back_at = time.time()
            time.sleep(3)
        finally:
            done.set()
            thread.join()
        failed = [(round(at - out_at, 2), status) for at, status in results if status != 200]
        assert not failed, failed
        tag = f"canary{os.getpid()}"
        on_b = bench.served_by("B", tag)
        sent = {n: at for n, (at, _) in enumerate(results)}
        assert not [n for n in on_b if out_at + 0.5 < sent[n] < last_round], \
            "B answered while out of the pool"
        assert [n for n in on_b if sent[n] > back_at], "B got no request after it came back"
        assert [n for n in on_b if sent[n] < out_at - 1], "B got no request before"
        print(f"{len(results)} requests through the edge, 0 failed; B out for "
              f"{back_at - out_at:.1f} s")

        # B's engine now names another model: out at the next round, and `donors reference`
        # refuses it in one line, writing nothing.
        bench.stop("modelB")
        env_b = ["env", "VLLM_STANDIN_MODEL_ID=other/model"]
        bench.start("modelB", [*env_b, *bench.model(1)])
        edge_failover_wait = time.monotonic() + 20
        while True:
            state = edge_canary.run_round(config)
            b = state["members"][f"{edge_failover.HOSTNAME} B"]
            if b["last_result"] != "no_answer" or time.monotonic() > edge_failover_wait:
                break
            time.sleep(0.5)
        assert b["verdict"] == "out" and b["last_failure"]["result"] == "mismatch", b
        before = path.read_text()
        b_box = a.model_copy(update=dict(caddy_https_port=ports[1]))
        capsys.readouterr()
        assert reference.run({"tb-4090b": b_box}, limited=True, timeout=30) == 1
        said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(said) == 1 and "the answer names model 'other/model'" in said[0], said
        assert path.read_text() == before
    finally:
        bench.down()


def test_every_donor_of_a_site_out_is_said_loudly(tmp_path: Path, capsys) -> None:
    """Both members answer as another model (the stand-in's VLLM_STANDIN_MODEL_ID): both out
    in one round, the state saved, and the journal's ALL OUT line for the site."""
    from donorkit.commands.transport import free_port

    port = free_port()
    proc = standin(tmp_path, port, env={"VLLM_STANDIN_MODEL_ID": "other/model"})
    try:
        config = {**KNOBS, "timeout": 10, "state_dir": str(tmp_path), "apply": False,
                  "sites": [{"hostname": "h.example", "checkpoint": "org/model", "upstreams": [
                      {"donor": d, "address": f"127.0.0.1:{port}", "reference": None}
                      for d in ("a", "b")]}]}
        state = edge_canary.run_round(config, post=plain_post(port))
    finally:
        proc.kill()
        proc.wait()
    assert {m["verdict"] for m in state["members"].values()} == {"out"}
    assert edge_canary.out_members(edge_canary.load_state(str(tmp_path))) == {
        ("h.example", f"127.0.0.1:{port}")}
    said = capsys.readouterr().out
    assert "ALL OUT: every donor of h.example (a, b) failed its canary" in said, said


def test_deploy_refuses_a_broken_reference_in_one_line(tmp_path: Path) -> None:
    """A reference file an edge would ship, edited by hand into something else: `donors
    deploy` says so in one line before pyinfra starts."""
    doc = fleet(tmp_path)
    doc["overrides"]["canary"]["references_dir"] = str(tmp_path / "references")
    box = load_inventory(TESTBED)[0]["tb-4090"]
    path = reference_path(tmp_path / "references", box.models["qwen"].checkpoint,
                          box.models["qwen"].revision, box.canary_stack("qwen"))
    path.parent.mkdir(parents=True)
    path.write_text('{"checkpoint": "someone/else"}')
    for name in ("exllamav3_wheel_cache", "engine_kernel_cache"):
        doc["overrides"][name] = str(tmp_path / name)
    said = one_line(donors_cli(tmp_path, doc, "deploy", "--dry", "--limit", "tb-edge"))
    assert f"{path}: field 'checkpoint'/'revision'" in said, said


def test_a_member_is_held_to_its_own_stacks_bound_else_the_wider_one(tmp_path: Path) -> None:
    """The edge's config gives each member the reference of its own stack and max_logprob_gap;
    with only another stack's reference (tb-3090's, an fp8-cache 3090 for a 4090), the wider
    max_logprob_gap_other_stack; with none, no reference (unjudged)."""
    donors, edges = load_inventory(TESTBED)
    edge = edges["tb-edge"].model_copy(update={"canary": edges["tb-edge"].canary.model_copy(
        update={"references_dir": str(tmp_path)})})
    site = edge.sites[0]
    first = site.upstreams[0]
    doc = {"checkpoint": site.checkpoint, "revision": first.revision, "max_tokens": 8,
           "prompts": [{"prompt": "p", "tokens": ["a"], "logprobs": [-0.5]}]}

    def members() -> list[dict]:
        return canary_config(edge)["sites"][0]["upstreams"]

    assert [m["reference"] for m in members()] == [None] * len(site.upstreams)
    other = donors["tb-3090"].canary_stack("qwen")
    assert other != first.stack
    path = reference_path(tmp_path, site.checkpoint, first.revision, other)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**doc, "stack": other}))
    assert {m["max_logprob_gap"] for m in members()} == {edge.canary.max_logprob_gap_other_stack}
    reference_path(tmp_path, site.checkpoint, first.revision, first.stack).write_text(
        json.dumps({**doc, "stack": first.stack}))
    own = members()[0]
    assert own["reference"]["stack"] == first.stack
    assert own["max_logprob_gap"] == edge.canary.max_logprob_gap
