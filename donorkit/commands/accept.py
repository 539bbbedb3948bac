"""Acceptance of donors (`make accept [LIMIT=host]`): what each box delivers, measured through its
public hostname with the OpenAI Python client (what the network's users run), recorded, and
compared with its card's baseline (docs/acceptance.md says what is measured, which way and how).

This module measures and is the command line; what does not touch the network (targets, tool
cases, the record, the comparison) is donorkit/commands/accept_records.py. Everything a donor
sends is its owner's word: token counts are what this client received, and every answer is capped
in bytes and time and shown bounded and escaped (donorkit/commands/transport.py).
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
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx2
from pydantic import ValidationError

from donorkit.commands.accept_records import (
    TOOL_CASES,
    TOOL_CHOICE_FLAG,
    TOOLS,
    EdgeForward,
    ModelResults,
    Record,
    Target,
    ToolCase,
    check_tool_call,
    compare,
    failures,
    forced_call_text,
    new_record,
    summary_table,
    targets_from_fleet,
    usage_problem,
)
from donorkit.commands.transport import (
    ForwardError,
    PinnedHTTPS,
    SshForward,
    capped_async_transport,
    client_context,
    shown,
)
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.limit import LimitError, select
from donorkit.inventory.paths import operator_path
from donorkit.inventory.pki import PkiError


def _client(target: Target) -> tuple[Any, httpx2.AsyncClient]:
    """An AsyncOpenAI client and its HTTP client for `target`: TLS server name and Host = the
    public hostname."""
    from openai import AsyncOpenAI

    url = httpx2.URL(target.base_url)
    _require_ca(target)
    verify: ssl.SSLContext | bool = True
    if url.scheme == "https":
        verify = client_context(target.ca_file, target.client)
    sni = target.hostname if url.host != target.hostname else None
    # keep-alive off, as on every hop of the seed's proxies (a pooled connection can be
    # half-open); one fresh connection per request. Each answer whole within the request
    # timeout (a deadline, not a wait per read) and transport.ANSWER_LIMIT bytes.
    limits = httpx2.Limits(max_keepalive_connections=0)
    transport = capped_async_transport(target.workload.request_timeout_s, sni=sni,
                                       verify=verify, limits=limits)
    http = httpx2.AsyncClient(transport=transport,
                             headers={"Host": target.hostname},
                             timeout=target.workload.request_timeout_s)
    return AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key="uncloseai-accept",
                       http_client=http, max_retries=0), http


def _require_ca(target: Target) -> None:
    if target.ca_file and not Path(target.ca_file).is_file():
        raise RuntimeError(f"no CA certificate at {target.ca_file} (the deploy creates the "
                           "private CA; or give --via for an edge)")


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _long_prompt(chars: int) -> str:
    """A unique first line (no prefix-cache hit) and varied filler text of `chars` characters."""
    head = f"Request {secrets.token_hex(8)}. Summarise the following log in one sentence.\n"
    words, i = [], 0
    while sum(len(w) + 1 for w in words) < chars:
        words.append(f"entry{i * 7919 % 100003} status={'ok' if i % 3 else 'retry'};")
        i += 1
    return head + " ".join(words)[: max(chars - len(head), 1)]


def _tokens_in(chunk: Any) -> int:
    """How many generated tokens a streamed chunk carries. With `return_token_ids` (asked for)
    vLLM puts the ids of the tokens a chunk delivers on its choice (`token_ids`: vLLM 0.26.0's
    chat_completion/protocol.py); a chunk may carry several when the engine outpaced this
    client (serving.py adds len(output.token_ids) a chunk), also where a tool or reasoning
    parser holds the text back. Without ids, a chunk with a delta is one token (not the role
    chunk that opens vLLM's streams: role set, no text)."""
    choices = getattr(chunk, "choices", None) or []
    if not isinstance(choices, list) or not choices:
        return 0
    ids = getattr(choices[0], "token_ids", None)
    if isinstance(ids, list) and ids and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return len(ids)
    delta = getattr(choices[0], "delta", None)
    if delta is None:
        return 0
    return int(not (getattr(delta, "role", None) and not getattr(delta, "content", None)))


def _count(usage: Any, field: str) -> int:
    """A token count of the donor's usage, refused unless a count."""
    value = getattr(usage, field, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RuntimeError(f"usage.{field} is not a token count: {shown(repr(value), 80)}")
    return value


async def _stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming chat request, timed and counted from the tokens the chunks delivered
    (_tokens_in); the donor's own usage (a vLLM extension, in every chunk) is recorded as
    what it claims, for the `usage` check."""
    started = time.monotonic()
    first = last = None
    usage = None
    received = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={**NO_THINKING, "ignore_eos": True, "return_token_ids": True})
    chunks, tail = 0, None  # what the stream carried, for the error when it had no usage
    async for chunk in stream:
        chunks, tail = chunks + 1, chunk
        if chunk.usage is not None:
            usage = chunk.usage
        tokens = _tokens_in(chunk)
        if tokens:
            received += tokens
            last = time.monotonic()
            first = first or last
    if usage is None or first is None:
        carried = json.dumps(tail.model_dump(exclude_none=True))[:300] if tail else "nothing"
        raise RuntimeError(f"the stream carried no usage (is this vLLM?): {chunks} chunk(s), "
                           f"the last {carried}")
    if received > max_tokens:
        raise RuntimeError(f"the stream delivered {received} tokens, {max_tokens} were asked for")
    return {"prompt_tokens": _count(usage, "prompt_tokens"),
            "completion_tokens": _count(usage, "completion_tokens"),
            "received_tokens": received, "prompt_chars": len(prompt),
            "ttft_s": first - started, "wall_s": last - started,
            "decode_tok_s": (received - 1) / (last - first) if received > 1 and last > first
            else None}


async def _chars_per_token(client, model: str) -> float:
    text = _long_prompt(2000)
    short = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
        extra_body=NO_THINKING)
    full = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=1,
        extra_body=NO_THINKING)
    claimed = _count(full.usage, "prompt_tokens") - _count(short.usage, "prompt_tokens")
    # A token is at least one character of this ASCII text, whatever the donor claims.
    return max(len(text) / max(claimed, 1), 1.0)


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
    return {"case": case.name, "ok": problem is None,
            "problem": None if problem is None else shown(problem),
            "calls": [{"name": shown(n, 64), "arguments": shown(a, 500)} for n, a in calls[:4]]}


async def measure(target: Target, progress: Callable[[str], None]) -> dict:
    """Every figure and check of one target, as the record's `results` (exceptions propagate;
    Unreachable where no connection opens). A home donor's through its edge's SSH forward, open
    for the whole measurement."""
    with ExitStack() as stack:
        forward = None
        if target.forward:
            _require_ca(target)  # the probe's handshake verifies the donor's Caddy
            forward = await asyncio.to_thread(_open_forward, stack, target.forward)
            target = replace(target, base_url=f"https://127.0.0.1:{forward.local_port}")
        why = await asyncio.to_thread(unreachable, target)
        if why:
            where = _forward_name(target.forward) if forward else target.base_url
            said = forward.said() if forward else ""
            raise Unreachable(f"{where}: {why}" + (f" (ssh: {said})" if said else ""))
        if target.route:
            progress(f"{target.base_url} as {target.hostname}: {target.route}")
        return await _measure_reached(target, progress)


def _forward_name(forward: EdgeForward) -> str:
    return f"edge {forward.edge}'s SSH forward to {forward.address}:{forward.port}"


def _open_forward(stack: ExitStack, forward: EdgeForward) -> SshForward:
    """The SSH forward through the edge, closed with `stack`; Unreachable when it does not come
    up (the edge down, its host key not known, the key refused: ssh's own words)."""
    try:
        return stack.enter_context(SshForward(forward.jump, forward.address, forward.port))
    except ForwardError as exc:
        raise Unreachable(f"{_forward_name(forward)}: {exc}") from None


async def _measure_reached(target: Target, progress: Callable[[str], None]) -> dict:
    w = target.workload
    out: dict[str, Any] = {"figures": {}, "checks": {}, "details": {}}
    client, http = _client(target)
    async with client:
        progress("models, version")
        listed = (await client.models.list()).data
        ids = [(m.id, getattr(m, "max_model_len", None)) for m in listed]
        out["details"]["models"] = [
            {"id": shown(i, 120), "max_model_len": n if isinstance(n, int) else shown(n, 40)}
            for i, n in ids[:8]]
        out["checks"]["models"] = {
            "ok": ids == [(target.checkpoint, target.max_model_len)], "required": True,
            "expected": {"id": target.checkpoint, "max_model_len": target.max_model_len}}
        reply = await http.get(f"{target.base_url}/version")
        reply.raise_for_status()
        version = reply.json()
        version = version.get("version") if isinstance(version, dict) else None
        out["details"]["version"] = {"version": None if version is None
                                     else shown(version, 64)}
        out["checks"]["version"] = {"ok": bool(version), "required": True}
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
            "received_tokens": [r["received_tokens"] for r in runs],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in runs)}
        streams = {"the chat stream": chat, "the prefill stream": prefill,
                   **{f"concurrent stream {i}": r for i, r in enumerate(runs, 1)}}
        problem = usage_problem(streams)
        out["checks"]["usage"] = {
            "ok": problem is None, "required": True, "problem": problem,
            "claimed_completion_tokens": sum(r["completion_tokens"] for r in streams.values()),
            "received_tokens": sum(r["received_tokens"] for r in streams.values())}

        acc = target.card_acceptance
        if not target.tool_calls:
            # A model served without tool calling (the seed's qwen unit) answers every tools
            # request with 400: nothing to measure, and not a failure of this box.
            out["details"]["tool_calls"] = (f"not enabled: the model's args have no "
                                            f"{TOOL_CHOICE_FLAG}")
            out["figures"]["tool_calls_ok"] = None
            return out
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

async def accept_target(target: Target, progress: Callable[[str], None]) -> dict:
    acc = target.card_acceptance
    try:
        res = await measure(target, progress)
    except Unreachable as exc:
        return {"unreachable": shown(str(exc), 500)}
    except Exception as exc:  # noqa: BLE001 - one donor's failure is recorded, the run goes on
        return {"error": shown(f"{type(exc).__name__}: {exc}".strip(), 500)}
    res["figures_compared"] = acc.compare_figures
    res["comparison"] = compare(res["figures"], acc.baseline, target.tolerance) \
        if acc.compare_figures else {}
    return res


async def run(targets: list[Target], results_dir: Path,
              progress: Callable[[str], None] | None = None,
              unreachable_out: dict[str, str] | None = None) -> list[Record]:
    """Accept every target (donor by donor: the figures of one box are not shared with another's
    load); write one record per donor; return the records. A donor no connection opens to gets
    no record: its cause goes into `unreachable_out` (donor -> why), once."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    gone = unreachable_out if unreachable_out is not None else {}
    records: dict[str, Record] = {}
    for target in targets:
        if target.donor in gone:
            continue
        started = datetime.now(timezone.utc).replace(microsecond=0)
        record = records.setdefault(target.donor, new_record(target, started))
        t0 = time.monotonic()
        res = await accept_target(
            target, lambda text, t=target, t0=t0: say(f"[{t.donor} {t.model} "
                                                      f"{time.monotonic() - t0:5.1f}s] {text}"))
        if "unreachable" in res:
            gone[target.donor] = res["unreachable"]
            records.pop(target.donor)
            continue
        result = ModelResults.model_validate({**res, "elapsed_s": time.monotonic() - t0})
        record.results[target.model] = result
        say(f"[{target.donor} {target.model}] done in {result.elapsed_s:.1f} s"
            + (f": {result.error}" if result.error else ""))
    results_dir.mkdir(parents=True, exist_ok=True)
    for rec in records.values():
        stamp = rec.started.strftime("%Y-%m-%dT%H%M%SZ")
        path = results_dir / f"{rec.donor}-{stamp}.json"
        path.write_text(rec.model_dump_json(indent=2, exclude={"path"}) + "\n")
        rec.path = str(path)
    return list(records.values())


class Unreachable(Exception):
    """No connection opens to where the client would connect: one line, no record."""


def unreachable(target: Target, timeout: float = 10) -> str | None:
    """Why no connection opens to where the client would connect (within `timeout`), or None:
    an unreachable donor is one line, not one failed request per step. A TCP connection; through
    an SSH forward a TLS handshake with the donor's Caddy (the forward's own end always accepts:
    only the handshake shows the edge reached the box)."""
    url = httpx2.URL(target.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        if target.forward:
            handshake = PinnedHTTPS(url.host, port, target.hostname,
                                    client_context(target.ca_file, target.client), timeout)
            try:
                handshake.connect()
            finally:
                handshake.close()
        else:
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
        operator_path(first.acceptance.results_dir)
    gone: dict[str, str] = {}
    records = asyncio.run(run(targets, results_dir, unreachable_out=gone))
    if records:
        print(summary_table(records))
    problems = [p for rec in records for p in failures(rec)]
    for rec in records:
        print(f"record: {rec.path}")
        if rec.policy.reason:
            print(f"  {rec.donor} ({rec.card}): {rec.policy.reason}")
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    for donor, why in gone.items():
        print(f"UNREACHABLE {donor} ({why})", file=sys.stderr)
    return 1 if problems or gone else 0


if __name__ == "__main__":
    sys.exit(main())
