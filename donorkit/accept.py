"""Acceptance of donors (`make accept [LIMIT=host]`): what each box delivers, measured through its
public hostname with the OpenAI Python client (what the network's users run), recorded, and
compared with its card's baseline.

Per donor and model identity it serves (the first public hostname routed to it):
- `/v1/models` lists the checkpoint with the configured `max_model_len`; `/version`;
- a streaming chat completion with `chat_template_kwargs: {"enable_thinking": false}` (the seed's
  clients send it): time to first token and decode tokens/s;
- prefill tokens/s on one long prompt; N concurrent long prompts and their wall time;
- tool-call fidelity: the cases in TOOL_CASES through the OpenAI tools API, each checked for one
  well-formed call of the expected function with the expected arguments.

Each long prompt starts with a fresh random line, so vLLM's prefix cache cannot serve it. Prompt
sizes are in tokens of the served model's tokenizer: a probe request measures its characters per
token first (usage.prompt_tokens), so the same workload data fits any model.

Which way: a donor's Caddy answers only clients with a certificate from the operator's client CA
(issue 15). Through an edge serving the hostname when that edge's pool for it is this donor alone
and it has no rate limit; otherwise (several donors behind the hostname: the figures would be a
mix; the seed's rate limit of 3 requests per second: the concurrent prompts would get 429) to the
donor's own Caddy with the public hostname as TLS server name and Host, presenting the operator's
client certificate (OPERATOR_CLIENT, issued under pki_dir/edges/ like an edge's). The record's
`route` says which and why; `--via URL` forces a base URL.

One JSON record per donor and run goes under the results folder; the figures are compared with
the card's baseline with a tolerance (data: `acceptance` in inventory/defaults.yml and each card
profile's `acceptance`); a figure worse than that, or a failed required check, makes the run exit
non-zero naming it. A card profile may say figures are not compared and tool calls are not
required (the testbed's CPU engine with random weights): the record then says so, with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import socket
import ssl
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx2
from pydantic import BaseModel, ConfigDict, ValidationError

from donorkit.fleet import REPO_ROOT, FleetError, load_inventory
from donorkit.limit import LimitError, select
from donorkit.paths import pki_dir
from donorkit.pki import OPERATOR_CLIENT, PkiError
from donorkit.render import pki_for
from donorkit.schema import (
    AcceptanceSettings,
    Baseline,
    CardAcceptance,
    Workload,
)

RECORD_VERSION = 1

# ------------------------------------------------------------------ data ----------------------


# Figures with a baseline, and which way is better.
FIGURES: dict[str, Literal["higher", "lower"]] = {
    "prefill_tok_s": "higher", "decode_tok_s": "higher",
    "ttft_s": "lower", "concurrent_wall_s": "lower",
}

# ------------------------------------------------------------------ tool-call cases -----------


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("get_weather", "Current weather for a city.",
          {"city": {"type": "string"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("convert_currency", "Convert an amount between currencies (ISO 4217 codes).",
          {"amount": {"type": "number"}, "from_currency": {"type": "string"},
           "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"]),
    _tool("set_timer", "Start a countdown timer.",
          {"minutes": {"type": "integer"}, "label": {"type": "string"}}, ["minutes"]),
    _tool("search_web", "Search the web.",
          {"query": {"type": "string"}, "max_results": {"type": "integer"}}, ["query"]),
    _tool("send_email", "Send an email.",
          {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
          ["to", "subject", "body"]),
    _tool("create_calendar_event", "Create a calendar event.",
          {"title": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
           "time": {"type": "string", "description": "HH:MM, 24-hour"}}, ["title", "date", "time"]),
]


@dataclass(frozen=True)
class ToolCase:
    name: str
    prompt: str
    function: str
    arguments: dict


TOOL_CASES = [
    ToolCase("weather", "What's the weather in Paris right now? Use celsius.", "get_weather",
             {"city": "Paris", "unit": "celsius"}),
    ToolCase("currency", "Convert 250 US dollars to euros.", "convert_currency",
             {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}),
    ToolCase("timer", "Set a 15 minute timer labelled tea.", "set_timer",
             {"minutes": 15, "label": "tea"}),
    ToolCase("search", "Search the web for 'vLLM prefix caching' and give me 3 results.",
             "search_web", {"query": "vLLM prefix caching", "max_results": 3}),
    ToolCase("email", "Email bob@example.com with subject 'Lunch' and body 'Noon at the cafe?'",
             "send_email", {"to": "bob@example.com", "subject": "Lunch",
                            "body": "Noon at the cafe?"}),
    ToolCase("calendar", "Put 'Dentist' in my calendar on 2026-12-03 at 14:30.",
             "create_calendar_event", {"title": "Dentist", "date": "2026-12-03", "time": "14:30"}),
]


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, bool) or isinstance(got, bool):
        return expected is got
    if isinstance(expected, int | float) and isinstance(got, int | float):
        return float(expected) == float(got)
    if isinstance(expected, str) and isinstance(got, str):
        return expected.strip().rstrip(".").casefold() == got.strip().rstrip(".").casefold()
    return expected == got


def check_tool_call(case: ToolCase, calls: list[tuple[str, str]]) -> str | None:
    """None when `calls` ([(function name, arguments JSON)]) is one well-formed call of the
    case's function with its arguments (strings compared without case or a trailing dot;
    numbers by value; no argument the function does not declare); else what is wrong."""
    if len(calls) != 1:
        return f"expected 1 tool call, got {len(calls)}"
    name, raw = calls[0]
    if name != case.function:
        return f"called {name!r}, expected {case.function!r}"
    try:
        args = json.loads(raw)
    except (TypeError, ValueError):
        return f"arguments are not JSON: {str(raw)[:80]!r}"
    if not isinstance(args, dict):
        return f"arguments are not an object: {str(raw)[:80]!r}"
    declared = next(t["function"]["parameters"]["properties"] for t in TOOLS
                    if t["function"]["name"] == case.function)
    unknown = sorted(set(args) - set(declared))
    if unknown:
        return f"undeclared arguments {unknown}"
    for key, want in case.arguments.items():
        if key not in args:
            return f"argument {key!r} missing"
        if not _same(want, args[key]):
            return f"argument {key!r} = {args[key]!r}, expected {want!r}"
    return None


def forced_call_text(case: ToolCase) -> str:
    """The Hermes-format text of the case's expected call (what the model should write)."""
    return ("<tool_call>\n" + json.dumps({"name": case.function, "arguments": case.arguments})
            + "\n</tool_call>")

# ------------------------------------------------------------------ targets -------------------


@dataclass
class Target:
    """One model identity on one donor, as reached through a public hostname."""

    donor: str
    card: str
    model: str                  # model identity (qwen, hermes)
    checkpoint: str             # what /v1/models must list
    max_model_len: int
    hostname: str               # the public hostname (Host header and TLS server name)
    base_url: str               # where the client connects, without /v1
    ca_file: str | None         # verify TLS against this bundle (None: the system's)
    workload: Workload
    card_acceptance: CardAcceptance
    tolerance: float
    stack: dict = field(default_factory=dict)   # pinned versions from the inventory
    client: tuple[str, str] | None = None       # client certificate and key presented, if any
    route: str = ""                             # which way the requests go, and why


def _connect_url(hostname: str, port: int) -> str:
    return f"https://{hostname}" + ("" if port == 443 else f":{port}")


# OPERATOR_CLIENT (donorkit/pki.py): the operator's own client certificate, under
# pki_dir/edges/; a donor's Caddy answers only the current edges' and this one, and gives
# /metrics to this one only.


def _edge_route(edges: dict[str, dict], donor: str, hostname: str) -> tuple[dict | None, str]:
    """The edge to measure `donor` through for `hostname`, or None, and why. Through an edge only
    when its site for the hostname has this donor alone (else its load balancer spreads the run
    over other donors, maybe of other cards, and the record would not be this donor's) and no
    rate limit (the seed's 3 events per second per client would refuse the concurrent prompts)."""
    why = "no edge serves it"
    for name, edge in sorted(edges.items()):
        site = next((s for s in edge["sites"] if s["hostname"] == hostname), None)
        if site is None:
            continue
        pool = [u["donor"] for u in site["upstreams"]]
        if pool != [donor]:
            why = f"edge {name} spreads it over {len(pool)} donors ({', '.join(pool)})"
        elif edge["rate_limit"]:
            why = f"edge {name} rate-limits it ({edge['rate_limit']['events']} per " \
                  f"{edge['rate_limit']['window']})"
        else:
            return edge, f"through edge {name} (this donor is its only upstream for {hostname})"
    return None, why


def targets_from_fleet(fleet: dict[str, dict], via: str | None = None,
                       edges: dict[str, dict] | None = None) -> list[Target]:
    """One Target per donor and model identity (its first hostname in sorted order), always
    with the hostname as TLS server name and Host. With `via` (a base URL), the client goes
    there. Else through an edge serving the hostname where that measures this donor alone
    (_edge_route), verified against our CA when the edge's public TLS is ours; else to the
    donor's own GPU-side Caddy (ssh_host, caddy_https_port), verified against our CA,
    presenting the operator's client certificate from the client CA (OPERATOR_CLIENT)."""
    targets = []
    for name, data in fleet.items():
        settings = AcceptanceSettings.model_validate(data["acceptance"])
        card = data["card"]
        card_acc = CardAcceptance.model_validate(card.get("acceptance", {}))
        workload = settings.workload.model_copy(
            update=card_acc.workload.model_dump(exclude_none=True))
        seen = set()
        for route in data["routes"]:
            model = data["models"][route["model"]]
            if route["model"] in seen:
                continue
            seen.add(route["model"])
            ca = pki_dir(data) / "ca.crt"
            client, edge = None, None
            if via:
                base, ca_file, route_note = via.rstrip("/"), None, f"through {via} (--via)"
            else:
                edge, route_note = _edge_route(edges or {}, name, route["hostname"])
            if edge:
                address = edge["ssh_hostname"]
                address = f"[{address}]" if ":" in address else address
                base = f"https://{address}:{edge['edge_https_port']}"
                ca_file = str(ca) if edge["public_tls"] == "private_ca" else None
            elif not via:
                base = f"https://{data['ssh_hostname']}:{data['caddy_https_port']}"
                ca_file = str(ca)
                pair = pki_for(data).client_pair(OPERATOR_CLIENT)
                client = (str(pair[0]), str(pair[1]))
                route_note = (f"to the donor's Caddy with client certificate {OPERATOR_CLIENT} "
                              f"({route_note})")
            targets.append(Target(
                donor=name, card=card["name"], model=route["model"],
                checkpoint=model["checkpoint"], max_model_len=model["max_model_len"],
                hostname=route["hostname"], base_url=base, ca_file=ca_file, workload=workload,
                card_acceptance=card_acc, tolerance=settings.tolerance,
                stack={k: data[k] for k in ("vllm_version", "torch_version") if k in data},
                client=client, route=route_note))
    return targets

# ------------------------------------------------------------------ measuring -----------------


def _client(target: Target) -> tuple[Any, httpx2.AsyncClient]:
    """An AsyncOpenAI client and its HTTP client for `target`: TLS server name and Host = the
    public hostname."""
    from openai import AsyncOpenAI

    url = httpx2.URL(target.base_url)
    if target.ca_file and not Path(target.ca_file).is_file():
        raise RuntimeError(f"no CA certificate at {target.ca_file} (the deploy creates the "
                           "private CA; or give --via for an edge)")
    verify: ssl.SSLContext | bool = True
    if url.scheme == "https":
        verify = ssl.create_default_context(cafile=target.ca_file)
        if target.client:
            verify.load_cert_chain(*target.client)
    sni = target.hostname if url.host != target.hostname else None

    class PublicName(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            if sni and url.scheme == "https":
                request.extensions["sni_hostname"] = sni
            return await super().handle_async_request(request)

    # keep-alive off, as on every hop of the seed's proxies (a pooled connection can be
    # half-open); one fresh connection per request.
    limits = httpx2.Limits(max_keepalive_connections=0)
    http = httpx2.AsyncClient(transport=PublicName(verify=verify, limits=limits),
                             headers={"Host": target.hostname},
                             timeout=target.workload.request_timeout_s)
    return AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key="uncloseai-accept",
                       http_client=http, max_retries=0), http


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _long_prompt(chars: int) -> str:
    """A unique first line (no prefix-cache hit) and varied filler text of `chars` characters."""
    head = f"Request {secrets.token_hex(8)}. Summarise the following log in one sentence.\n"
    words, i = [], 0
    while sum(len(w) + 1 for w in words) < chars:
        words.append(f"entry{i * 7919 % 100003} status={'ok' if i % 3 else 'retry'};")
        i += 1
    return head + " ".join(words)[: max(chars - len(head), 1)]


async def _stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming chat request; times from the chunks' running usage (a vLLM extension:
    decode counts tokens even when a chunk carries no printable text)."""
    started = time.monotonic()
    first = last = None
    first_count = usage = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={**NO_THINKING, "ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is None:
            continue
        usage = chunk.usage
        if usage.completion_tokens and first is None:
            first, first_count = time.monotonic(), usage.completion_tokens
        if usage.completion_tokens:
            last = time.monotonic()
    if usage is None or first is None:
        raise RuntimeError("the stream carried no usage (is this vLLM?)")
    decoded = usage.completion_tokens - first_count
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "ttft_s": first - started, "wall_s": last - started,
            "decode_tok_s": decoded / (last - first) if decoded > 0 and last > first else None}


async def _chars_per_token(client, model: str) -> float:
    text = _long_prompt(2000)
    short = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
        extra_body=NO_THINKING)
    full = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=1,
        extra_body=NO_THINKING)
    return len(text) / max(full.usage.prompt_tokens - short.usage.prompt_tokens, 1)


async def _tool_case(client, model: str, case: ToolCase, forced: bool) -> dict:
    extra = dict(NO_THINKING)
    if forced:  # vLLM's structured outputs write the expected call: the parser must read it back
        extra["structured_outputs"] = {"regex": re.escape(forced_call_text(case))}
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": case.prompt}], tools=TOOLS,
        tool_choice="auto", max_tokens=256, temperature=0, extra_body=extra)
    message = reply.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    problem = check_tool_call(case, calls)
    return {"case": case.name, "ok": problem is None, "problem": problem,
            "calls": [{"name": n, "arguments": a} for n, a in calls]}


async def measure(target: Target, progress: Callable[[str], None]) -> dict:
    """Every figure and check of one target, as the record's `results` (exceptions propagate)."""
    w = target.workload
    why = await asyncio.to_thread(unreachable, target.base_url)
    if why:
        raise Unreachable(f"{target.base_url}: {why}")
    if target.route:
        progress(f"{target.base_url} as {target.hostname}: {target.route}")
    out: dict[str, Any] = {"figures": {}, "checks": {}, "details": {}}
    client, http = _client(target)
    async with client:
        progress("models, version")
        listed = (await client.models.list()).data
        ids = [(m.id, getattr(m, "max_model_len", None)) for m in listed]
        out["details"]["models"] = [{"id": i, "max_model_len": n} for i, n in ids]
        out["checks"]["models"] = {
            "ok": ids == [(target.checkpoint, target.max_model_len)], "required": True,
            "expected": {"id": target.checkpoint, "max_model_len": target.max_model_len}}
        reply = await http.get(f"{target.base_url}/version")
        reply.raise_for_status()
        version = reply.json()
        out["details"]["version"] = version
        out["checks"]["version"] = {"ok": bool(version.get("version")), "required": True}
        model = target.checkpoint

        progress(f"chat stream ({w.decode_max_tokens} tokens)")
        chat = await _stream(client, model, "Write a short story about a lighthouse.",
                             w.decode_max_tokens)
        out["figures"]["ttft_s"] = chat["ttft_s"]
        out["figures"]["decode_tok_s"] = chat["decode_tok_s"]
        out["details"]["chat"] = chat

        cpt = await _chars_per_token(client, model)
        out["details"]["chars_per_token"] = cpt
        progress(f"prefill ({w.prefill_prompt_tokens} prompt tokens)")
        prefill = await _stream(client, model, _long_prompt(int(w.prefill_prompt_tokens * cpt)), 1)
        out["figures"]["prefill_tok_s"] = prefill["prompt_tokens"] / prefill["ttft_s"]
        out["details"]["prefill"] = prefill

        progress(f"{w.concurrent_prompts} concurrent prompts of {w.concurrent_prompt_tokens} "
                 "tokens")
        started = time.monotonic()
        runs = await asyncio.gather(*(
            _stream(client, model, _long_prompt(int(w.concurrent_prompt_tokens * cpt)),
                    w.concurrent_max_tokens) for _ in range(w.concurrent_prompts)))
        out["figures"]["concurrent_wall_s"] = time.monotonic() - started
        out["details"]["concurrent"] = {
            "prompts": len(runs), "prompt_tokens": [r["prompt_tokens"] for r in runs],
            "completion_tokens": [r["completion_tokens"] for r in runs],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in runs)}

        acc = target.card_acceptance
        cases = []
        for i, case in enumerate(TOOL_CASES, 1):
            progress(f"tool call {i}/{len(TOOL_CASES)} ({case.name})")
            cases.append(await _tool_case(client, model, case, forced=False))
        passed = sum(c["ok"] for c in cases)
        out["figures"]["tool_calls_ok"] = passed
        out["checks"]["tool_call_fidelity"] = {
            "ok": passed == len(cases), "required": acc.tool_calls_required,
            "passed": passed, "of": len(cases), "cases": cases}
        if acc.forced_tool_call_check:
            progress("tool-call parser (forced call text)")
            forced = [await _tool_case(client, model, c, forced=True) for c in TOOL_CASES[:2]]
            out["checks"]["tool_call_parser"] = {
                "ok": all(c["ok"] for c in forced), "required": True, "cases": forced}
    return out

# ------------------------------------------------------------------ the record ----------------


class Loose(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CheckRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    ok: bool
    required: bool


class Comparison(Loose):
    value: float | None
    baseline: float
    limit: float
    better: Literal["higher", "lower"]
    ok: bool


class ModelResults(Loose):
    """One model identity's results; either measured (figures, checks, ...) or an error."""

    error: str | None = None
    figures: dict[Literal["ttft_s", "decode_tok_s", "prefill_tok_s", "concurrent_wall_s",
                          "tool_calls_ok"], float | None] | None = None
    checks: dict[str, CheckRecord] | None = None
    details: dict[str, Any] | None = None
    figures_compared: bool | None = None
    comparison: dict[str, Comparison] | None = None
    elapsed_s: float


class Policy(Loose):
    compare_figures: bool
    tool_calls_required: bool
    tolerance: float
    reason: str
    baseline: dict[str, float | str]


class Record(Loose):
    """One donor's acceptance run, as written under the results folder."""

    record_version: Literal[1]
    donor: str
    card: str
    started: datetime
    via: str
    route: str = ""             # which way the requests went, and why
    stack: dict[str, str]
    policy: Policy
    workload: Workload
    results: dict[str, ModelResults]
    path: str | None = None


# ------------------------------------------------------------------ comparing -----------------


def compare(figures: dict, baseline: Baseline, tolerance: float) -> dict:
    """{figure: {value, baseline, limit, ok}} for every figure the baseline has."""
    result = {}
    for name, better in FIGURES.items():
        reference = getattr(baseline, name)
        value = figures.get(name)
        if reference is None:
            continue
        limit = reference * (1 - tolerance) if better == "higher" else reference * (1 + tolerance)
        ok = value is not None and (value >= limit if better == "higher" else value <= limit)
        result[name] = {"value": value, "baseline": reference, "limit": limit, "better": better,
                        "ok": ok}
    return result


def failures(record: dict) -> list[str]:
    """What makes this record a failed acceptance, each naming the figure or check."""
    if record.get("error"):
        return [f"{record['donor']}: {record['error']}"]
    out = []
    for model, res in record["results"].items():
        where = f"{record['donor']} {model}"
        if res.get("error"):
            out.append(f"{where}: {res['error']}")
            continue
        for name, check in res["checks"].items():
            if check["required"] and not check["ok"]:
                out.append(f"{where}: check {name} failed")
        for name, cmp in res.get("comparison", {}).items():
            if not cmp["ok"]:
                sign = ">=" if cmp["better"] == "higher" else "<="
                value = "none" if cmp["value"] is None else f"{cmp['value']:.3g}"
                out.append(f"{where}: {name} {value}, needs {sign} {cmp['limit']:.3g} "
                           f"(baseline {cmp['baseline']:.3g})")
    return out


async def accept_target(target: Target, progress: Callable[[str], None]) -> dict:
    acc = target.card_acceptance
    try:
        res = await measure(target, progress)
    except Unreachable as exc:
        return {"unreachable": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one donor's failure is recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}".strip()[:500]}
    res["figures_compared"] = acc.compare_figures
    res["comparison"] = compare(res["figures"], acc.baseline, target.tolerance) \
        if acc.compare_figures else {}
    return res


def new_record(target: Target, started: datetime) -> dict:
    acc = target.card_acceptance
    return {
        "record_version": RECORD_VERSION,
        "donor": target.donor, "card": target.card,
        "started": started.isoformat(timespec="seconds"),
        "via": target.base_url,
        "route": target.route,
        "stack": dict(target.stack),
        "policy": {"compare_figures": acc.compare_figures,
                   "tool_calls_required": acc.tool_calls_required,
                   "tolerance": target.tolerance, "reason": acc.reason,
                   "baseline": acc.baseline.model_dump(exclude_none=True)},
        "workload": target.workload.model_dump(),
        "results": {},
    }


def summary_table(records: list[dict]) -> str:
    cols = ["donor", "model", "card", "vllm", "ttft s", "decode t/s", "prefill t/s",
            "conc wall s", "tools", "result"]
    rows = []
    for rec in records:
        for model, res in rec["results"].items() or [("-", {"error": rec.get("error")})]:
            f = res.get("figures", {})
            fidelity = res.get("checks", {}).get("tool_call_fidelity", {})

            def fmt(v: Any, spec: str = ".3g") -> str:
                return "-" if v is None else format(v, spec)
            rows.append([rec["donor"], model, rec["card"],
                         str(res.get("details", {}).get("version", {}).get("version", "-")),
                         fmt(f.get("ttft_s")), fmt(f.get("decode_tok_s")),
                         fmt(f.get("prefill_tok_s")), fmt(f.get("concurrent_wall_s")),
                         f"{fidelity['passed']}/{fidelity['of']}" if fidelity else "-",
                         "FAIL" if failures({**rec, "results": {model: res}}) else "pass"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(widths[i]) for i, v in enumerate(r))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])


async def run(targets: list[Target], results_dir: Path,
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """Accept every target (donor by donor: the figures of one box are not shared with another's
    load); write one record per donor; return the records."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    records: dict[str, dict] = {}
    for target in targets:
        started = datetime.now(timezone.utc)
        record = records.setdefault(target.donor, new_record(target, started))
        t0 = time.monotonic()
        if record.get("unreachable"):
            continue
        res = await accept_target(
            target, lambda text, t=target, t0=t0: say(f"[{t.donor} {t.model} "
                                                      f"{time.monotonic() - t0:5.1f}s] {text}"))
        if "unreachable" in res:
            record["unreachable"] = res["unreachable"]
            continue
        res["elapsed_s"] = time.monotonic() - t0
        record["results"][target.model] = res
        say(f"[{target.donor} {target.model}] done in {res['elapsed_s']:.1f} s"
            + (f": {res['error']}" if res.get("error") else ""))
    results_dir.mkdir(parents=True, exist_ok=True)
    for rec in records.values():
        if rec.get("unreachable"):  # nothing measured: no record
            continue
        stamp = rec["started"].replace(":", "").replace("+0000", "Z")
        path = results_dir / f"{rec['donor']}-{stamp}.json"
        path.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
        rec["path"] = str(path)
    return list(records.values())


class Unreachable(Exception):
    """No connection opens to where the client would connect: one line, no record."""


def unreachable(base_url: str, timeout: float = 10) -> str | None:
    """Why no TCP connection opens to where the client would connect (within `timeout`), or
    None: an unreachable donor is one line, not one failed request per step."""
    url = httpx2.URL(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.host, port), timeout).close()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make accept", description=__doc__.split("\n\n")[0])
    parser.add_argument("--donors", help="donors file (default: $DONORS_FILE or "
                                         "inventory/donors.yml)")
    parser.add_argument("--limit", action="append", default=[], metavar="NAME",
                        help="only these donors: names, groups (donors, a card profile) or "
                             "globs, as pyinfra's --limit (repeatable, or a comma list)")
    parser.add_argument("--via", metavar="URL",
                        help="connect through this base URL (an edge) instead of each donor's "
                             "GPU-side Caddy; the public hostname is still sent as Host")
    parser.add_argument("--results", metavar="DIR", help="where records go (default: data)")
    args = parser.parse_args(argv)
    try:
        fleet, edges = load_inventory(args.donors)
        fleet = select(args.limit, fleet, edges)[0]
        if not fleet:
            raise FleetError(f"--limit {','.join(args.limit)}: selects no donor")
        targets = targets_from_fleet(fleet, args.via, edges)
    except (FleetError, PkiError, ValidationError, LimitError) as exc:
        print(f"accept: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    first = next(iter(fleet.values()))
    results_dir = Path(args.results) if args.results else \
        REPO_ROOT / first["acceptance"]["results_dir"]
    records = asyncio.run(run(targets, results_dir))
    gone = [rec for rec in records if rec.get("unreachable")]
    records = [rec for rec in records if not rec.get("unreachable")]
    if records:
        print(summary_table(records))
    problems = [p for rec in records for p in failures(rec)]
    for rec in records:
        print(f"record: {rec['path']}")
        reason = rec["policy"]["reason"]
        if reason:
            print(f"  {rec['donor']} ({rec['card']}): {reason}")
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    for rec in gone:
        print(f"UNREACHABLE {rec['donor']} ({rec['unreachable']})", file=sys.stderr)
    return 1 if problems or gone else 0


if __name__ == "__main__":
    sys.exit(main())
