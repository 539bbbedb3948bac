"""The pure half of `make accept` (donorkit/commands/accept.py is the measuring and the command
line): the tool-call cases (data: donorkit/commands/tool_cases.yml) and their check, which way each
donor is reached (targets), the record as a model, the comparison with the card's baseline and the
failures it names, and the summary table. Nothing here opens a connection."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

from donorkit.inventory.card_profiles import Baseline, CardAcceptance, Workload
from donorkit.inventory.host_data import DonorBox, EdgeBox, SshJump
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT
from donorkit.render.templates import pki_for

RECORD_VERSION = 1
TOOL_CASES_FILE = Path(__file__).with_name("tool_cases.yml")

# Figures with a baseline, and which way is better.
FIGURES: dict[str, Literal["higher", "lower"]] = {
    "prefill_tok_s": "higher", "decode_tok_s": "higher",
    "ttft_s": "lower", "concurrent_wall_s": "lower",
}

# What a donor's `usage` may claim beyond what `make accept` received (donorkit/commands/accept.py
# counts one streamed chunk per token): a few tokens, or this fraction of them, whichever is more.
# The figures are the received tokens' whatever the claim: the slack gains a donor nothing.
USAGE_SLACK_TOKENS, USAGE_SLACK = 4, 0.05
# Prompt tokens a chat template adds to the characters sent (a token is at least one
# character of the ASCII text sent; Llama 3.1's and Qwen's templates add a few dozen tokens).
TEMPLATE_TOKENS = 256

# ------------------------------------------------------------------ tool-call cases -----------


@dataclass(frozen=True)
class ToolCase:
    name: str
    prompt: str
    function: str
    arguments: dict


def _load_tool_cases(path: Path = TOOL_CASES_FILE) -> tuple[list[dict], list[ToolCase]]:
    """The tools (as the OpenAI tools API takes them) and the cases, from the data file."""
    doc = yaml.safe_load(path.read_text())
    tools = [{"type": "function", "function": {
        "name": name, "description": tool["description"],
        "parameters": {"type": "object", "properties": tool["properties"],
                       "required": tool["required"]}}} for name, tool in doc["tools"].items()]
    return tools, [ToolCase(**case) for case in doc["cases"]]


TOOLS, TOOL_CASES = _load_tool_cases()


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


def usage_problem(streams: dict[str, dict]) -> str | None:
    """None when every stream's claimed usage fits what was received (`completion_tokens` at
    most `received_tokens` plus the slack; `prompt_tokens` at most the characters sent plus a
    template's); else the first that does not, in one line."""
    for name, s in streams.items():
        allowed = s["received_tokens"] + max(USAGE_SLACK_TOKENS,
                                             int(s["received_tokens"] * USAGE_SLACK))
        if s["completion_tokens"] > allowed:
            return (f"{name} claimed {s['completion_tokens']} completion tokens, "
                    f"{s['received_tokens']} received (at most {allowed} accepted)")
        if s["prompt_tokens"] > s["prompt_chars"] + TEMPLATE_TOKENS:
            return (f"{name} claimed {s['prompt_tokens']} prompt tokens for "
                    f"{s['prompt_chars']} characters sent")
    return None


def forced_call_text(case: ToolCase) -> str:
    """The Hermes-format text of the case's expected call (what the model should write)."""
    return ("<tool_call>\n" + json.dumps({"name": case.function, "arguments": case.arguments})
            + "\n</tool_call>")


@dataclass(frozen=True)
class EdgeForward:
    """A home donor's Caddy (`reach: tunnel`) as this machine reaches it: through the SSH of the
    edge it is jumped through (its `ssh_jump`), an OpenSSH local forward for the whole
    measurement (donorkit.commands.transport.SshForward)."""

    edge: str                   # the edge's name
    jump: SshJump               # its SSH data
    address: str                # the donor's tunnel address, as the edge reaches it
    port: int                   # its Caddy's HTTPS port


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
    tool_calls: bool = True     # the model's flags enable tool calling (--enable-auto-tool-choice)
    forward: EdgeForward | None = None  # a home donor's Caddy: base_url through the edge's SSH


# vLLM answers a tools request only where the model is served with this flag (and a parser).
TOOL_CHOICE_FLAG = "--enable-auto-tool-choice"

# OPERATOR_CLIENT (donorkit/inventory/pki.py): the operator's own client certificate, under
# pki_dir/edges/; a donor's Caddy answers only the current edges' and this one, and gives
# /metrics to this one only.


def _edge_route(edges: dict[str, EdgeBox], donor: str, hostname: str
                ) -> tuple[EdgeBox | None, str]:
    """The edge to measure `donor` through for `hostname`, or None, and why. Through an edge only
    when its site for the hostname has this donor alone (else its load balancer spreads the run
    over other donors, maybe of other cards, and the record would not be this donor's) and no
    rate limit (the seed's 3 events per second per client would refuse the concurrent prompts)."""
    why = "no edge serves it"
    for name, edge in sorted(edges.items()):
        site = next((s for s in edge.sites if s.hostname == hostname), None)
        if site is None:
            continue
        pool = [u.donor for u in site.upstreams]
        if pool != [donor]:
            why = f"edge {name} spreads it over {len(pool)} donors ({', '.join(pool)})"
        elif edge.rate_limit:
            why = f"edge {name} rate-limits it ({edge.rate_limit.events} per " \
                  f"{edge.rate_limit.window})"
        else:
            return edge, f"through edge {name} (this donor is its only upstream for {hostname})"
    return None, why


def targets_from_fleet(fleet: dict[str, DonorBox], via: str | None = None,
                       edges: dict[str, EdgeBox] | None = None) -> list[Target]:
    """One Target per donor and model identity (its first hostname in sorted order), always
    with the hostname as TLS server name and Host. With `via` (a base URL), the client goes
    there. Else through an edge serving the hostname where that measures this donor alone
    (_edge_route), verified against our CA when the edge's public TLS is ours; else to the
    donor's own GPU-side Caddy (ssh_host, caddy_https_port), verified against our CA,
    presenting the operator's client certificate from the client CA (OPERATOR_CLIENT); a home
    donor's Caddy (at its tunnel address) through its edge's SSH (`forward`, _forward)."""
    targets = []
    for name, data in fleet.items():
        settings = data.acceptance
        card = data.card
        card_acc = card.acceptance
        workload = settings.workload.model_copy(
            update=card_acc.workload.model_dump(exclude_none=True))
        seen = set()
        for route in data.routes:
            model = data.models[route.model]
            if route.model in seen:
                continue
            seen.add(route.model)
            ca = pki_dir(data) / "ca.crt"
            client, edge, forward = None, None, None
            if via:
                base, ca_file, route_note = via.rstrip("/"), None, f"through {via} (--via)"
            else:
                edge, route_note = _edge_route(edges or {}, name, route.hostname)
            if edge:
                address = edge.ssh_hostname
                address = f"[{address}]" if ":" in address else address
                base = f"https://{address}:{edge.edge_https_port}"
                ca_file = str(ca) if edge.public_tls == "private_ca" else None
            elif not via:
                base = f"https://{data.ssh_hostname}:{data.caddy_https_port}"
                ca_file = str(ca)
                pair = pki_for(data).client_pair(OPERATOR_CLIENT)
                client = (str(pair[0]), str(pair[1]))
                forward = _forward(data)
                through = (f" at {forward.address}:{forward.port} through edge {forward.edge}'s "
                           "SSH forward," if forward else "")
                route_note = (f"to the donor's Caddy{through} with client certificate "
                              f"{OPERATOR_CLIENT} ({route_note})")
            targets.append(Target(
                donor=name, card=card.name, model=route.model,
                checkpoint=model.checkpoint, max_model_len=model.max_model_len,
                hostname=route.hostname, base_url=base, ca_file=ca_file, workload=workload,
                card_acceptance=card_acc, tolerance=settings.tolerance,
                stack={"vllm_version": data.vllm_version, "torch_version": data.torch_version},
                client=client, route=route_note,
                tool_calls=TOOL_CHOICE_FLAG in model.args, forward=forward))
    return targets


def _forward(data: DonorBox) -> EdgeForward | None:
    """How a home donor's Caddy is reached from here: its tunnel address (its ssh_hostname) is
    the edge's to reach, so through the edge's SSH, as its own SSH goes (ssh_jump); None for a
    donor reached directly."""
    if data.reach != "tunnel" or data.ssh_jump_data is None:
        return None
    return EdgeForward(edge=data.ssh_jump, jump=data.ssh_jump_data, address=data.ssh_hostname,
                       port=data.caddy_https_port)


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


def failures(record: Record) -> list[str]:
    """What makes this record a failed acceptance, each naming the figure or check."""
    out = []
    for model, res in record.results.items():
        where = f"{record.donor} {model}"
        if res.error:
            out.append(f"{where}: {res.error}")
            continue
        for name, check in (res.checks or {}).items():
            if check.required and not check.ok:
                why = (check.model_extra or {}).get("problem")
                out.append(f"{where}: check {name} failed" + (f": {why}" if why else ""))
        for name, cmp in (res.comparison or {}).items():
            if not cmp.ok:
                sign = ">=" if cmp.better == "higher" else "<="
                value = "none" if cmp.value is None else f"{cmp.value:.3g}"
                out.append(f"{where}: {name} {value}, needs {sign} {cmp.limit:.3g} "
                           f"(baseline {cmp.baseline:.3g})")
    return out


def new_record(target: Target, started: datetime) -> Record:
    """A donor's record before its results: who, which way, the policy and the workload."""
    acc = target.card_acceptance
    return Record(
        record_version=RECORD_VERSION, donor=target.donor, card=target.card, started=started,
        via=target.base_url, route=target.route, stack=dict(target.stack),
        policy=Policy(compare_figures=acc.compare_figures,
                      tool_calls_required=acc.tool_calls_required, tolerance=target.tolerance,
                      reason=acc.reason, baseline=acc.baseline.model_dump(exclude_none=True)),
        workload=target.workload, results={})


def summary_table(records: list[Record]) -> str:
    cols = ["donor", "model", "card", "vllm", "ttft s", "decode t/s", "prefill t/s",
            "conc wall s", "tools", "result"]

    def fmt(v: Any, spec: str = ".3g") -> str:
        return "-" if v is None else format(v, spec)

    rows = []
    for rec in records:
        for model, res in rec.results.items():
            f = res.figures or {}
            fidelity = (res.checks or {}).get("tool_call_fidelity")
            version = (res.details or {}).get("version", {}).get("version") or "-"
            one = rec.model_copy(update={"results": {model: res}})
            rows.append([rec.donor, model, rec.card, str(version),
                         fmt(f.get("ttft_s")), fmt(f.get("decode_tok_s")),
                         fmt(f.get("prefill_tok_s")), fmt(f.get("concurrent_wall_s")),
                         f"{fidelity.passed}/{fidelity.of}" if fidelity else "-",
                         "FAIL" if failures(one) else "pass"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(widths[i]) for i, v in enumerate(r))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])
