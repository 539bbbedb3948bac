"""`make status`'s table, from the rows donorkit/commands/status.py collects (pure: no connection).

Donors: one row per model a box serves; edges: one row per pool member as that edge sees it; an
unreachable box: one line with the cause."""

from __future__ import annotations

DONOR_COLUMNS = ["DONOR", "CARD", "DRIVER", "GPU MEM", "UTIL", "UNIT", "SINCE",
                 "MODEL @ REVISION", "READY", "DRAINED", "RUN/WAIT", "KV", "VLLM", "TORCH",
                 "TOOLKIT", "CERT UNTIL", "CANARY"]
EDGE_COLUMNS = ["EDGE", "CADDY", "TOOLKIT", "HOSTNAME", "MEMBER", "SEEN", "IN FLIGHT", "CANARY",
                "PASS", "LAST FAILURE"]
# The narrow table (the default of `donors status`; -v: the wide one above), within 100 columns
# for a fleet's usual names: what answers "is it serving, which revision, how loaded".
NARROW_DONOR = ["DONOR", "CARD", "UNIT", "SINCE", "REVISION", "READY", "RUN/WAIT", "KV",
                "CANARY"]
NARROW_EDGE = ["EDGE", "HOSTNAME", "MEMBER", "SEEN", "IN FLIGHT", "CANARY"]
_NARROW_DONOR_CELLS = [DONOR_COLUMNS.index(c) for c in ("DONOR", "CARD", "UNIT", "SINCE")]
CELL = 20   # a narrow cell longer than this is cut, with "~"


def duration(seconds: float | None) -> str:
    """45s, 12m, 3h05m, 2d04h."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _num(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def gpu_memory(gpu: dict) -> str:
    used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
    if used is None or total is None:
        return "-"
    return f"{used / 1024:.1f}/{total / 1024:.1f} GiB"


def model_cell(model: dict) -> str:
    """What the box serves: its checkpoint and the revision its unit runs (12 hex); `!` when
    that differs from the inventory's pin (the box is not on the data's revision)."""
    revision = model.get("revision")
    mark = "" if revision == model.get("pinned") else " (inventory: " + \
        (model.get("pinned") or "none")[:12] + ")"
    return f"{model['checkpoint']} @ {(revision or 'no revision')[:12]}{mark}"


def ready_cell(model: dict) -> str:
    if model["ready"]:
        return "yes"
    return f"NO: {model.get('problem') or 'not listed'}"


def queue_cell(metrics: dict) -> str:
    running = metrics.get("vllm:num_requests_running")
    waiting = metrics.get("vllm:num_requests_waiting")
    if running is None and waiting is None:
        return "-"
    return f"{_num(running)}/{_num(waiting)}"


def kv_cell(metrics: dict) -> str:
    value = metrics.get("vllm:kv_cache_usage_perc")
    return "-" if value is None else f"{value * 100:.0f}%"


def canary_cell(verdicts: list[dict] | None) -> str:
    """The edges' canary verdict on a donor's model: OUT when any edge has it out, unjudged
    when none judges it, else in; `-` when no edge reports one."""
    if not verdicts:
        return "-"
    kinds = {v["verdict"] for v in verdicts}
    return "OUT" if "out" in kinds else "unjudged" if kinds == {"unjudged"} else \
        "in" if kinds <= {"in", "unjudged"} else "?"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def donor_rows(row: dict) -> list[list[str]]:
    gpu = row.get("gpu", {})
    card = gpu.get("card") or f"? {gpu.get('error', '')}".strip()
    rows = []
    for model in row.get("models", []) or [{}]:
        if not model:
            rows.append([row["name"], card, gpu.get("driver", "-"), gpu_memory(gpu),
                         "-", "(no model)", *["-"] * 11])
            continue
        rows.append([
            row["name"], card, gpu.get("driver", "-"), gpu_memory(gpu),
            _num(gpu.get("utilization_pct"), ".0f") + ("%" if gpu.get("utilization_pct")
                                                      is not None else ""),
            f"{model['unit'].removesuffix('.service')} {model['state']}",
            duration(model.get("active_for_s")), model_cell(model), ready_cell(model),
            "yes" if row.get("drained") else "no", queue_cell(model.get("metrics", {})),
            kv_cell(model.get("metrics", {})), row.get("vllm") or "-", row.get("torch") or "-",
            row.get("toolkit") or "-", (model.get("cert_expires") or "-")[:10],
            canary_cell(model.get("canary"))])
    return rows


def edge_rows(row: dict) -> list[list[str]]:
    return [[row["name"], row.get("caddy", "?"), row.get("toolkit") or "-", member["hostname"],
             f"{member['donor']} ({member['address']})", member["seen"],
             "-" if member["in_flight"] is None else str(member["in_flight"]),
             canary_cell([member["canary"]] if member.get("canary") else []),
             rate((member.get("canary") or {}).get("pass_rate")),
             ((member.get("canary") or {}).get("last_failure") or {}).get("why") or "-"]
            for member in row.get("pool", [])]


def table(columns: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    return ["  ".join(v.ljust(widths[i]) for i, v in enumerate(r)).rstrip()
            for r in [columns, *rows]]


def unreachable_line(row: dict) -> str:
    return f"{row['name']}: UNREACHABLE ({row['role']}, {row['address']}): {row['unreachable']}"


def _cut(text: str, width: int = CELL) -> str:
    return text if len(text) <= width else text[:width - 1] + "~"


def narrow_donor_rows(row: dict) -> list[list[str]]:
    """donor_rows' cells that fit a terminal: the card without its vendor words, the unit by
    its model, the revision alone (12 hex, `!` when it is not the inventory's pin), READY yes
    or NO (why: a line under the table, not_ready_lines)."""
    out = []
    for line, model in zip(donor_rows(row), row.get("models", []) or [{}], strict=True):
        name, card, unit, since = (line[i] for i in _NARROW_DONOR_CELLS)
        card = card.replace("NVIDIA ", "").replace("GeForce ", "")
        revision = (model.get("revision") or "none")[:12] if model else "-"
        if model and model.get("revision") != model.get("pinned"):
            revision += "!"
        ready = "yes" if model.get("ready") else "NO" if model else "-"
        out.append([_cut(name), _cut(card, 12), _cut(unit.removeprefix("vllm-")), since,
                    revision, ready, line[DONOR_COLUMNS.index("RUN/WAIT")],
                    line[DONOR_COLUMNS.index("KV")], line[DONOR_COLUMNS.index("CANARY")]])
    return out


def not_ready_lines(rows: list[dict]) -> list[str]:
    """Under the narrow table: why each model marked NO is not ready (its own line)."""
    return [f"{row['name']} {model.get('unit', '').removesuffix('.service')}: "
            f"{ready_cell(model)}" for row in rows for model in row.get("models", []) or []
            if not model.get("ready")]


def out_lines(rows: list[dict]) -> list[str]:
    """Under the narrow table: each donor an edge took out of a pool, and why (the edge's last
    failure of its canary)."""
    return [f"{member['donor']}: OUT of {member['hostname']} on {row['name']} (canary): "
            f"{(member['canary'].get('last_failure') or {}).get('why') or '?'}"
            for row in rows if row["role"] == "edge" for member in row.get("pool", [])
            if (member.get("canary") or {}).get("verdict") == "out"]


def render_table(rows: list[dict], wide: bool = True) -> str:
    """The donors' table, the edges' table, then one line per unreachable box. `wide`: every
    column; else the narrow one (a revision marked `!` is not the inventory's pin)."""
    out: list[str] = []
    donors = [r for r in rows if r["role"] == "donor" and not r.get("unreachable")]
    edges = [r for r in rows if r["role"] == "edge" and not r.get("unreachable")]
    if donors:
        out += (table(DONOR_COLUMNS, [line for r in donors for line in donor_rows(r)]) if wide
                else table(NARROW_DONOR, [line for r in donors for line in narrow_donor_rows(r)])
                + not_ready_lines(donors))
    edge_lines = [line for r in edges for line in edge_rows(r)]
    if edge_lines and not wide:
        edge_lines = [[_cut(line[0]), _cut(line[3], 30), _cut(line[4].split(" (")[0]), line[5],
                       line[6], line[7]] for line in edge_lines]
    if edge_lines:
        out += ([""] if out else []) + table(EDGE_COLUMNS if wide else NARROW_EDGE, edge_lines)
    if edge_lines and not wide:
        out += out_lines(edges)
    gone = [unreachable_line(r) for r in rows if r.get("unreachable")]
    if gone:
        out += ([""] if out else []) + gone
    return "\n".join(out)
