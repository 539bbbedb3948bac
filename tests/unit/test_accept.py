"""`make accept` without a donor: comparison with a baseline, the failure messages, tool-call
checking, the record's structure, and the client's TLS path (server name, Host, our CA) against
a real local HTTPS server with a certificate from our PKI."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from donorkit.commands import accept as a
from donorkit.commands import accept_records as core
from donorkit.commands import transport
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from donorkit.inventory.schema import RateLimit
from tests.support import version_server
from tests.support.host_edit import put

BASE = core.Baseline(prefill_tok_s=1653, concurrent_wall_s=30.5, source="seed")


def test_compare_within_tolerance_passes_and_worse_fails() -> None:
    ok = core.compare({"prefill_tok_s": 1500, "concurrent_wall_s": 34.0}, BASE, 0.15)
    assert ok["prefill_tok_s"]["ok"] and ok["concurrent_wall_s"]["ok"]
    assert ok["prefill_tok_s"]["limit"] == pytest.approx(1653 * 0.85)
    assert ok["concurrent_wall_s"]["limit"] == pytest.approx(30.5 * 1.15)
    bad = core.compare({"prefill_tok_s": 1300, "concurrent_wall_s": 36.0}, BASE, 0.15)
    assert not bad["prefill_tok_s"]["ok"] and not bad["concurrent_wall_s"]["ok"]
    # Better than the baseline always passes; a figure without a baseline is not compared.
    best = core.compare({"prefill_tok_s": 9000, "concurrent_wall_s": 1.0, "ttft_s": 99}, BASE, 0)
    assert set(best) == {"prefill_tok_s", "concurrent_wall_s"}
    assert all(c["ok"] for c in best.values())


def test_missing_figure_fails_its_comparison() -> None:
    assert not core.compare({}, BASE, 0.15)["prefill_tok_s"]["ok"]


def _record(figures: dict, checks: dict | None = None, compare: bool = True,
            required: bool = True) -> dict:
    acc = core.CardAcceptance(baseline=BASE, compare_figures=compare, tool_calls_required=required)
    res = {"figures": figures, "details": {}, "figures_compared": compare, "elapsed_s": 1.0,
           "checks": checks or {"models": {"ok": True, "required": True}},
           "comparison": core.compare(figures, acc.baseline, 0.15) if compare else {}}
    return _as_record("qwen-3090", "rtx3090", {"qwen": res})


def _as_record(donor: str, card: str, results: dict) -> core.Record:
    """A record as `make accept` writes it, around these results."""
    record = core.new_record(_target(donor=donor, card=card), datetime.now(timezone.utc))
    return record.model_copy(update={"results": {
        m: core.ModelResults.model_validate({"elapsed_s": 1.0, **r}) for m, r in results.items()}})


def test_failures_name_the_figure_and_the_check() -> None:
    rec = _record({"prefill_tok_s": 1200.0, "concurrent_wall_s": 20.0},
                  {"models": {"ok": False, "required": True},
                   "tool_call_fidelity": {"ok": False, "required": True}})
    problems = core.failures(rec)
    assert any("prefill_tok_s 1.2e+03, needs >= 1.41e+03" in p for p in problems), problems
    assert "qwen-3090 qwen: check models failed" in problems
    assert "qwen-3090 qwen: check tool_call_fidelity failed" in problems
    assert not any("concurrent_wall_s" in p for p in problems)


def test_not_compared_and_not_required_do_not_fail() -> None:
    rec = _record({"prefill_tok_s": 1.0}, {"tool_call_fidelity": {"ok": False,
                                                                   "required": False}},
                  compare=False)
    assert core.failures(rec) == []


def test_error_fails() -> None:
    rec = _as_record("x", "rtx3090", {"qwen": {"error": "APITimeoutError: timed out"}})
    assert core.failures(rec) == ["x qwen: APITimeoutError: timed out"]


CASE = core.TOOL_CASES[1]  # convert_currency(amount=250, from_currency=USD, to_currency=EUR)


@pytest.mark.parametrize(("calls", "problem"), [
    ([("convert_currency", '{"amount": 250.0, "from_currency": "usd", "to_currency": "EUR."}')],
     None),
    ([], "expected 1 tool call, got 0"),
    ([("convert_currency", "{}")] * 2, "expected 1 tool call, got 2"),
    ([("get_weather", '{"city": "Paris"}')], "called 'get_weather', expected 'convert_currency'"),
    ([("convert_currency", '{"amount": 250,')], "arguments are not JSON"),
    ([("convert_currency", "[250]")], "arguments are not an object"),
    ([("convert_currency", '{"amount": 25, "from_currency": "USD", "to_currency": "EUR"}')],
     "argument 'amount' = 25, expected 250"),
    ([("convert_currency", '{"amount": 250, "to_currency": "EUR"}')],
     "argument 'from_currency' missing"),
    ([("convert_currency", '{"amount": 250, "from_currency": "USD", "to_currency": "EUR", '
                           '"fee": 1}')], "undeclared arguments ['fee']"),
    ([("convert_currency", '{"amount": true, "from_currency": "USD", "to_currency": "EUR"}')],
     "argument 'amount' = True, expected 250"),
])
def test_tool_call_check(calls: list, problem: str | None) -> None:
    got = core.check_tool_call(CASE, calls)
    assert (got is None) if problem is None else (got is not None and got.startswith(problem)), got


def test_tool_cases_cover_distinct_declared_functions() -> None:
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in core.TOOLS}
    assert len(core.TOOL_CASES) == 6
    assert len({c.function for c in core.TOOL_CASES}) == 6
    for case in core.TOOL_CASES:
        params = declared[case.function]
        assert set(params["required"]) <= set(case.arguments) <= set(params["properties"])
        # The forced Hermes text parses back to exactly the expected call.
        text = core.forced_call_text(case)
        body = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert core.check_tool_call(case, [(body["name"], json.dumps(body["arguments"]))]) is None


def _target(**kw) -> core.Target:
    workload = core.Workload(decode_max_tokens=8, prefill_prompt_tokens=100, concurrent_prompts=2,
                          concurrent_prompt_tokens=50, concurrent_max_tokens=4,
                          request_timeout_s=10)
    base = dict(donor="tb-cpu", card="cpu-testbed", model="qwen", checkpoint="o/m",
                max_model_len=4096, hostname="qwen.example.test", base_url="http://x",
                ca_file=None, workload=workload, card_acceptance=core.CardAcceptance(),
                tolerance=0.15)
    return core.Target(**{**base, **kw})


def _measured() -> dict:
    return {"figures": {"ttft_s": 0.1, "decode_tok_s": 90.0, "prefill_tok_s": 3000.0,
                        "concurrent_wall_s": 1.2, "tool_calls_ok": 0},
            "checks": {"models": {"ok": True, "required": True},
                       "tool_call_fidelity": {"ok": False, "required": False, "passed": 0,
                                              "of": 6, "cases": []}},
            "details": {"version": {"version": "0.32.0"}}}


def test_record_structure_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_measure(target, progress):  # the engine is tested in the testbed
        progress("measuring")
        return _measured()

    monkeypatch.setattr(a, "measure", fake_measure)
    acc = core.CardAcceptance(compare_figures=False, tool_calls_required=False,
                           reason="CPU engine, random weights")
    said: list[str] = []
    records = asyncio.run(a.run([_target(card_acceptance=acc, stack={"vllm_version": "0.32.0"})],
                                tmp_path, said.append))
    assert any("measuring" in s for s in said) and any("done in" in s for s in said)
    written = list(tmp_path.glob("tb-cpu-*.json"))
    assert len(written) == 1 and records[0].path == str(written[0])
    record = core.Record.model_validate_json(written[0].read_text())
    assert record.policy.compare_figures is False
    assert record.policy.reason == "CPU engine, random weights"
    assert record.results["qwen"].comparison == {}
    assert core.failures(records[0]) == []
    table = core.summary_table(records)
    assert "tb-cpu" in table and "0/6" in table and "pass" in table
    # A broken record is refused with the field named.
    data = json.loads(written[0].read_text())
    del data["policy"]["reason"]
    with pytest.raises(ValidationError, match="policy.reason"):
        core.Record.model_validate(data)


def test_a_failing_donor_is_recorded_and_the_others_go_on(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_measure(target, progress):
        if target.donor == "down":
            raise ConnectionRefusedError("refused")
        return _measured()

    monkeypatch.setattr(a, "measure", fake_measure)
    acc = core.CardAcceptance(baseline=core.Baseline(prefill_tok_s=5000))
    records = asyncio.run(a.run([_target(donor="down"), _target(donor="slow",
                                                                card_acceptance=acc)],
                                tmp_path, lambda _: None))
    problems = [p for r in records for p in core.failures(r)]
    assert problems[0] == "down qwen: ConnectionRefusedError: refused"
    assert problems[1].startswith("slow qwen: prefill_tok_s 3e+03, needs >= 4.25e+03")
    assert "FAIL" in core.summary_table(records)
    for path in tmp_path.glob("*.json"):
        core.Record.model_validate_json(path.read_text())


def test_workload_data_is_strict() -> None:
    with pytest.raises(ValidationError):
        core.Workload(decode_max_tokens=0, prefill_prompt_tokens=1, concurrent_prompts=1,
                   concurrent_prompt_tokens=1, concurrent_max_tokens=1, request_timeout_s=1)
    with pytest.raises(ValidationError):
        core.CardAcceptance.model_validate({"baseline": {"prefill": 1}})


def test_long_prompt_is_unique_and_sized() -> None:
    one, two = a._long_prompt(3000), a._long_prompt(3000)
    assert len(one) == 3000 and one != two and one.split("\n", 1)[1] == two.split("\n", 1)[1]


async def _get_version(target: core.Target) -> dict:
    """GET /version with `make accept`'s own client for that target."""
    client, http = a._client(target)
    async with client:
        reply = await http.get(f"{target.base_url}/version")
        return reply.json()


def test_client_sends_public_name_and_verifies_our_ca(tmp_path: Path) -> None:
    """Connecting to an address (the donor's ssh_host) with the public hostname as TLS server
    name and Host, the certificate checked against our CA, as `make accept` does per donor."""
    ca = str(tmp_path / "pki" / "ca.crt")
    with version_server.serve(Pki(tmp_path / "pki"), "tb-cpu", "qwen.example.test", "0.32.0",
                              tmp_path) as caddy:
        base = caddy.base_url
        assert asyncio.run(_get_version(_target(base_url=base, ca_file=ca))) == \
            {"version": "0.32.0"}
        assert caddy.names == ["qwen.example.test"]
        assert caddy.hosts == ["qwen.example.test"]
        # A certificate for another name, or no CA, is refused.
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate"):
            asyncio.run(_get_version(_target(base_url=base, ca_file=ca,
                                             hostname="other.example.test")))
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate"):
            asyncio.run(_get_version(_target(base_url=base, ca_file=None)))


def test_route_edge_only_for_a_lone_unlimited_donor_else_client_certificate(
        tmp_path: Path) -> None:
    """Donors answer only the client CA's certificates (issue 15): `make accept` goes through an
    edge only where that measures this donor alone and unthrottled; else to the donor's Caddy
    with the operator's client certificate, issued under pki_dir/edges/."""
    fleet, edges = load_inventory(REPO_ROOT / "tests/testbed/donors.yml")
    fleet = {n: fleet[n].model_copy(update={"pki_dir": str(tmp_path / "pki")})
             for n in ("tb-4090", "tb-4090b")}
    # tb-edge spreads hermes.ai.unturf.com over both: each donor is measured on its own Caddy.
    targets = core.targets_from_fleet(fleet, None, edges)
    assert [t.base_url for t in targets] == ["https://10.213.0.11:443", "https://10.213.0.13:443"]
    for t in targets:
        assert t.hostname == "hermes.ai.unturf.com"
        assert t.client == (str(tmp_path / "pki/edges/operator-accept.crt"),
                            str(tmp_path / "pki/edges/operator-accept.key"))
        assert t.ca_file == str(tmp_path / "pki/ca.crt")
        assert "spreads it over 2 donors" in t.route
    assert (tmp_path / "pki/edges/operator-accept.key").stat().st_mode & 0o777 == 0o600
    # The same edge with tb-4090 alone behind it: through the edge, no client certificate.
    site = edges["tb-edge"].sites[0]
    edges["tb-edge"] = put(edges["tb-edge"], ("sites", 0, "upstreams"),
                           [u for u in site.upstreams if u.donor == "tb-4090"])
    one = core.targets_from_fleet({"tb-4090": fleet["tb-4090"]}, None, edges)[0]
    assert (one.base_url, one.client) == ("https://10.213.0.20:443", None)
    assert one.ca_file == str(tmp_path / "pki/ca.crt")  # the edge's public TLS is our CA here
    assert one.route.startswith("through edge tb-edge")
    # ... unless it rate-limits (the concurrent prompts would get 429): its Caddy again.
    edges["tb-edge"] = edges["tb-edge"].model_copy(update={"rate_limit": RateLimit(
        events=3, window="1s", key="{remote_host}")})
    one = core.targets_from_fleet({"tb-4090": fleet["tb-4090"]}, None, edges)[0]
    assert one.base_url == "https://10.213.0.11:443" and one.client is not None
    assert "rate-limits it (3 per 1s)" in one.route
    # --via wins over both.
    one = core.targets_from_fleet({"tb-4090": fleet["tb-4090"]}, "https://edge.example/", edges)[0]
    assert (one.base_url, one.client, one.ca_file) == ("https://edge.example", None, None)


def test_client_presents_the_operator_certificate_to_a_caddy_requiring_one(
        tmp_path: Path) -> None:
    """A server that requires a certificate from our client CA (as every donor's Caddy does)
    answers `make accept`'s client with the operator's pair, and refuses it without one."""
    pki = Pki(tmp_path / "pki")
    ca = str(tmp_path / "pki" / "ca.crt")
    pair = tuple(str(p) for p in pki.client_pair(OPERATOR_CLIENT))
    with version_server.serve(pki, "tb-cpu", "qwen.example.test", "0.32.0", tmp_path,
                              client_ca=True) as caddy:
        base = caddy.base_url
        assert asyncio.run(_get_version(_target(base_url=base, ca_file=ca, client=pair))) == \
            {"version": "0.32.0"}
        with pytest.raises(Exception):  # noqa: B017 - the handshake fails (alert or reset)
            asyncio.run(_get_version(_target(base_url=base, ca_file=ca)))


def test_pki_dir_in_the_home_is_one_place_for_render_rollout_and_accept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21, hole 7: `pki_dir: ~/...` meant the home in the deploy and a folder under the
    repository in rollout and accept. One resolver (donorkit.inventory.paths.pki_dir) for all."""
    from donorkit.inventory.paths import pki_dir
    from donorkit.render.templates import pki_for

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fleet, edges = load_inventory(REPO_ROOT / "tests/testbed/donors.yml")
    data = fleet["tb-4090"].model_copy(update={"pki_dir": "~/operator-pki"})
    where = tmp_path / "home/operator-pki"
    assert pki_dir(data) == where and pki_for(data).directory == where
    [target] = core.targets_from_fleet({"tb-4090": data}, "https://via.example", {})
    [target] = core.targets_from_fleet({"tb-4090": data}, None, {})
    assert target.ca_file == str(where / "ca.crt")
    assert target.client == (str(where / "edges/operator-accept.crt"),
                             str(where / "edges/operator-accept.key"))
    assert transport.edge_client_pair(data, "tb-edge") == (where / "edges/tb-edge.crt",
                                                           where / "edges/tb-edge.key")
    assert transport.ca_file(data) == where / "ca.crt"
    assert not (REPO_ROOT / "~").exists()


def test_only_the_resolver_reads_pki_dir() -> None:
    """Every other module asks donorkit.inventory.paths.pki_dir: no second way to read the
    setting."""
    import re

    readers = []
    for folder in ("donorkit", "tasks", "tests/verify", "bench"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if re.search(r"""\[["']pki_dir["']\]|\.pki_dir\b""", text):
                readers.append(str(path.relative_to(REPO_ROOT)))
    assert readers == ["donorkit/inventory/paths.py"], readers


def test_tool_calls_are_measured_only_where_the_model_is_served_with_them(
        tmp_path: Path) -> None:
    """The seed's qwen unit has no --enable-auto-tool-choice: vLLM answers every tools request
    with 400 (seen on the H200, 2026-12-01), so accept must not count that against the box;
    hermes has the flag and its tool calls are measured."""
    fleet, _ = load_inventory(REPO_ROOT / "gpu/engine.yml")
    fleet = {n: d.model_copy(update={"pki_dir": str(tmp_path / "pki")}) for n, d in fleet.items()}
    targets = {t.model: t for t in a.targets_from_fleet(fleet, "http://127.0.0.1:1", {})}
    assert targets["qwen"].tool_calls is False
    assert targets["hermes"].tool_calls is True


def measure_standin(env: dict[str, str] | None = None, tool_calls: bool = False) -> dict:
    """accept's whole measurement against the testbed's vLLM stand-in (a real HTTP server, run
    here with `env` added to its environment)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    standin = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/testbed/standins/"
                                                    "vllm-standin"), "serve", "o/m", "--host",
                                "127.0.0.1", "--port", str(port), "--max-model-len", "4096"],
                               env={**os.environ, "VLLM_STANDIN_LOAD_DELAY": "0", **(env or {})},
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while a.unreachable(_target(base_url=f"http://127.0.0.1:{port}")):
            assert time.monotonic() < deadline and standin.poll() is None
            time.sleep(0.1)
        target = _target(base_url=f"http://127.0.0.1:{port}", tool_calls=tool_calls)
        return asyncio.run(a.measure(target, lambda _: None))
    finally:
        standin.terminate()
        standin.wait()


def test_measure_against_the_testbeds_vllm_standin() -> None:
    """accept's whole measurement (models, version, the chat stream, prefill, the concurrent
    prompts) with the real OpenAI client against the testbed's vLLM stand-in, as the testbed's
    home donor is measured: every figure and required check there."""
    out = measure_standin()
    assert out["checks"]["models"]["ok"] and out["checks"]["version"]["ok"]
    figures = out["figures"]
    for name in ("ttft_s", "decode_tok_s", "prefill_tok_s", "concurrent_wall_s"):
        assert figures[name] and figures[name] > 0, (name, figures)
    assert out["details"]["chat"]["completion_tokens"] == 8
    assert out["details"]["concurrent"]["prompts"] == 2
    assert 3 < out["details"]["chars_per_token"] < 5  # characters / 4, as the stand-in counts


def _accepted(out: dict) -> list[str]:
    """The failures of a record holding these results, compared with a baseline."""
    acc = core.CardAcceptance(baseline=core.Baseline(decode_tok_s=1.0))
    res = {**out, "figures_compared": True, "elapsed_s": 1.0,
           "comparison": core.compare(out["figures"], acc.baseline, 0.15)}
    return core.failures(_as_record("tb-cpu", "cpu-testbed", {"qwen": res}))


def test_an_honest_donors_usage_matches_what_was_received() -> None:
    """Issue 32, hole 6: the tokens counted are the chunks received (one per token); an
    honest donor's usage says as many, and it passes."""
    out = measure_standin()
    usage = out["checks"]["usage"]
    assert usage["ok"] and usage["problem"] is None
    assert usage["claimed_completion_tokens"] == usage["received_tokens"] == 8 + 1 + 2 * 4
    assert out["details"]["chat"]["received_tokens"] == 8
    assert _accepted(out) == []


def test_tokens_merged_into_one_chunk_are_counted_by_their_ids() -> None:
    """vLLM sends several tokens in one chunk when the engine outpaces the client (the real CPU
    engine's concurrent streams did: 32 tokens in 21 chunks): each chunk's token ids count,
    so an honest donor still passes; counting chunks would have failed it."""
    out = measure_standin({"VLLM_STANDIN_TOKENS_PER_CHUNK": "3"})
    usage = out["checks"]["usage"]
    assert usage["ok"] and usage["problem"] is None
    assert usage["claimed_completion_tokens"] == usage["received_tokens"] == 8 + 1 + 2 * 4
    assert out["details"]["chat"]["received_tokens"] == 8
    assert _accepted(out) == []


def test_a_donor_inflating_its_usage_fails_acceptance() -> None:
    """A stand-in donor claiming three times the tokens it streams: the figures are still
    what was received (its decode rate is not tripled), and the usage check fails with one
    line saying what it claimed and what came."""
    out = measure_standin({"VLLM_STANDIN_USAGE_FACTOR": "3"})
    chat = out["details"]["chat"]
    assert chat["completion_tokens"] == 24 and chat["received_tokens"] == 8
    # 7 tokens after the first, between its arrival and the last's (not 21).
    assert out["figures"]["decode_tok_s"] == pytest.approx(7 / (chat["wall_s"] - chat["ttft_s"]))
    assert not out["checks"]["usage"]["ok"]
    assert _accepted(out) == [
        "tb-cpu qwen: check usage failed: the chat stream claimed 24 completion tokens, "
        "8 received (at most 12 accepted)"]


def test_a_stream_without_usage_says_what_it_carried() -> None:
    """An engine's error inside a 200 stream (a chunk with no usage, no choices) is named in the
    error, not only "no usage"."""
    from types import SimpleNamespace

    from openai.types.chat import ChatCompletionChunk

    async def chunks():
        yield ChatCompletionChunk.construct(object="error", message="KV cache is full")

    async def create(**_):
        return chunks()

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    with pytest.raises(RuntimeError, match=r"no usage \(is this vLLM\?\): 1 chunk\(s\), the last "
                                           r'\{"object": "error", "message": "KV cache is full"'):
        asyncio.run(a._stream(client, "o/m", "hi", 4))
