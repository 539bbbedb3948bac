"""The edge's canary runner: every pool member of every site is sent the canary (files/canary.py)
directly, as the edge's Caddy reaches it, and taken out of the edge's pools when its answers stop
matching the reference recorded on a box the operator trusts; back after it passes again.

Runs on an edge under the system's `python3 -I -S` (standard library only), as the caddy user
(it needs the edge's client certificate and key, readable by the caddy group, and Caddy's admin
socket, and nothing else). Two commands, both reading the config the deploy rendered
(/etc/uncloseai/canary/canary.json, donorkit/render/canary_files.py):

  edge_canary.py run CONFIG     one round (the timer's service): each member asked, its state
                                updated, the edge's Caddy config applied when the out-set changed
  edge_canary.py apply CONFIG   Caddy's config now: the deployed Caddyfile adapted (`caddy
                                adapt`), minus the out members' upstreams, loaded through the
                                admin API (caddy.service's reload and start-post run this)

The state file (StateDirectory, state.json) is the truth of who is out: written atomically,
whatever Caddy was told. Every change of a member's verdict is logged (stdout: the journal) with
its evidence. A member's answer is untrusted: canary.parse_answer bounds and checks it.

Verdicts: `in` (passing, or not yet failed `fail_after` times in a row), `out` (failed
`fail_after` canaries in a row, or answered with a model id other than its route's checkpoint:
out at once; back `in` after `pass_after` passes in a row), `unjudged` (no reference for its
checkpoint and revision: it stays in; a wrong model id still takes it out). No answer at all
(refused, timed out, 502/503/504 from its Caddy: its model is down) counts neither way: the
health check handles a donor that is down, and an honest donor restarting must not leave its
pool for it. Any other HTTP status is a failed canary.

A site whose every member is out answers 502 at the edge (no upstream): a wrong answer is worse
than none. Said loudly in the journal at each round while it lasts.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

# canary.py lies beside this file (`-I` leaves the script's folder off sys.path).
_spec = importlib.util.spec_from_file_location("canary", Path(__file__).with_name("canary.py"))
canary = importlib.util.module_from_spec(_spec)
sys.modules["canary"] = canary
_spec.loader.exec_module(canary)

STATE_FILE = "state.json"
STATE_VERSION = 1
CONFIG_LIMIT = 4 << 20
# What an ordinary client of the network sends; the canary looks like one (no marker header).
USER_AGENT = "OpenAI/Python 1.59.7"
# The donor's Caddy when its model is down or restarting: no answer, counted neither way (the
# health check takes such a donor out). Any other status but 200 is a failed canary.
GATEWAY_DOWN = (502, 503, 504)
ADAPT_TIMEOUT = 60
ADMIN_TIMEOUT = 60


def log(text: str) -> None:
    print(text, flush=True)


# --- config and state -------------------------------------------------------------------------
def load_config(path: str) -> dict:
    """The deploy's config (root's file, readable by caddy): read as it is."""
    with open(path, "rb") as handle:
        return json.loads(handle.read(CONFIG_LIMIT))


def member_key(hostname: str, donor: str) -> str:
    return f"{hostname} {donor}"


def load_state(state_dir: str) -> dict:
    try:
        with open(os.path.join(state_dir, STATE_FILE), "rb") as handle:
            state = json.loads(handle.read(CONFIG_LIMIT))
    except FileNotFoundError:
        return {"version": STATE_VERSION, "members": {}}
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION \
            or not isinstance(state.get("members"), dict):
        raise ValueError(f"{state_dir}/{STATE_FILE}: not a canary state of version "
                         f"{STATE_VERSION}")
    return state


def save_state(state_dir: str, state: dict) -> None:
    """Atomically: a reader (the reload, `donors status`) sees the old state or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=".state.", dir=state_dir)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(state_dir, STATE_FILE))
    except BaseException:
        os.unlink(tmp)
        raise


def out_members(state: dict) -> set[tuple[str, str]]:
    """{(hostname, upstream address)} of the members out of rotation."""
    return {(m["hostname"], m["address"]) for m in state["members"].values()
            if m.get("verdict") == "out"}


# --- asking a member --------------------------------------------------------------------------
class MemberHTTPS(http.client.HTTPSConnection):
    """HTTPS to a member's address with the site's hostname as SNI and Host, our CA, the edge's
    client certificate: as the edge's Caddy reaches it."""

    def __init__(self, address: str, hostname: str, context: ssl.SSLContext,
                 timeout: float) -> None:
        host, _, port = address.rpartition(":")
        super().__init__(hostname, int(port), context=context, timeout=timeout)
        self._address = host.strip("[]")

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def tls_context(config: dict) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=config["ca"])
    context.load_cert_chain(config["client_cert"], config["client_key"])
    return context


def request_headers(hostname: str) -> dict[str, str]:
    """The headers a client's completion reaches a donor with through the edge (Caddy's proxy:
    Go's Accept-Encoding and Connection: close with keepalive off, the X-Forwarded-* it adds),
    so that a canary looks like one. Not sent: X-Forwarded-For / X-Real-IP (a client's
    address; the edge has none of its own to give)."""
    return {"Content-Type": "application/json", "Accept": "application/json",
            "User-Agent": USER_AGENT, "Accept-Encoding": "gzip", "Connection": "close",
            "X-Forwarded-Proto": "https", "X-Forwarded-Host": hostname}


def post_completion(address: str, hostname: str, body: bytes, context: ssl.SSLContext,
                    timeout: float) -> tuple[int, bytes]:
    """(status, body up to the answer limit + 1 byte: parse_answer refuses a longer one), the
    whole exchange within `timeout` seconds (a donor dripping its answer byte by byte gets
    TimeoutError, not a round held for hours)."""
    deadline = time.monotonic() + timeout
    connection = MemberHTTPS(address, hostname, context, timeout)
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers=request_headers(hostname))
        sock = connection.sock  # the response keeps reading it after the connection lets go
        response = connection.getresponse()
        chunks, size = [], 0
        while size <= canary.ANSWER_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole answer within {timeout:g} s")
            sock.settimeout(left)
            chunk = response.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
        if response.getheader("Content-Encoding", "").strip().lower() == "gzip":
            # Bounded: at most the answer limit + 1 byte unpacked (a gzip bomb stops there).
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(
                raw, canary.ANSWER_LIMIT + 1)
        return response.status, raw
    finally:
        connection.close()


def first_difference(reference: list, answers: list) -> str | None:
    """Where the answers first leave the reference: prompt number, position, both tokens."""
    for n, (ref, got) in enumerate(zip(reference, answers, strict=True)):
        for i, token in enumerate(ref.tokens):
            theirs = got.tokens[i] if i < len(got.tokens) else None
            if theirs != token:
                return f"prompt {n} token {i}: {token!r} expected, {theirs!r} answered"
    return None


def check_member(config: dict, site: dict, upstream: dict, context: ssl.SSLContext,
                 post=post_completion) -> dict:
    """One canary round on one member: {result: pass|fail|mismatch|no_answer|unjudged, why, ...}.
    `post` is the HTTPS exchange (a test may hand another transport)."""
    checkpoint = site["checkpoint"]
    reference = upstream.get("reference")
    prompts = reference["prompts"] if reference else [{"prompt": p} for p in canary.PROMPTS]
    max_tokens = reference["max_tokens"] if reference else canary.MAX_TOKENS
    answers = []
    for entry in prompts:
        body = canary.request_body(checkpoint, entry["prompt"], max_tokens)
        try:
            status, raw = post(upstream["address"], site["hostname"], body, context,
                               config["timeout"])
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return {"result": "no_answer", "why": f"{type(exc).__name__}: {exc}"[:200]}
        if status in GATEWAY_DOWN:
            return {"result": "no_answer", "why": f"HTTP {status} (its model is not up)"}
        if status != 200:
            return {"result": "fail", "why": f"HTTP {status} to a completion"}
        try:
            answer = canary.parse_answer(raw, max_tokens)
        except canary.BadAnswer as exc:
            return {"result": "fail", "why": f"bad answer: {exc}"[:200]}
        if answer.model != checkpoint:
            return {"result": "mismatch",
                    "why": f"answered as model {answer.model[:200]!r}, not {checkpoint}"}
        answers.append(answer)
    if not reference:
        return {"result": "unjudged", "why": "no reference for its checkpoint and revision"}
    expected = [canary.Answer(checkpoint, tuple(p["tokens"]), tuple(p["logprobs"]))
                for p in reference["prompts"]]
    scored = canary.score(expected, answers)
    # Its own stack's reference, else another stack's with that stack's wider bound.
    why = canary.verdict(scored, config["min_agree"],
                         upstream.get("max_logprob_gap", config["max_logprob_gap"]))
    evidence = {"agree": round(scored.agree, 4),
                "gap": None if scored.gap == float("inf") else round(scored.gap, 4),
                "matched": scored.matched, "total": scored.total,
                "first_difference": first_difference(expected, answers)}
    return {"result": "fail" if why else "pass", "why": why, "evidence": evidence}


# --- state transitions ------------------------------------------------------------------------
def update(member: dict, outcome: dict, config: dict, now: float) -> str | None:
    """Apply one round's outcome to a member's state; the line to log when its verdict
    changed, else None."""
    result, before = outcome["result"], member.get("verdict", "in")
    member["checked_at"] = now
    member["last_result"] = result
    if result == "no_answer":
        member["last_error"] = outcome["why"]
        return None
    member.pop("last_error", None)
    passed = result in ("pass", "unjudged")
    if result != "unjudged":
        history = ((member.get("history") or []) + [passed])[-config["window"]:]
        member["history"] = history
        member["pass_rate"] = round(sum(history) / len(history), 4)
    if passed:
        member["passes"] = member.get("passes", 0) + 1
        member["fails"] = 0
    else:
        member["fails"] = member.get("fails", 0) + 1
        member["passes"] = 0
        member["last_failure"] = {"at": now, "result": result, "why": outcome["why"],
                                  **({"evidence": outcome["evidence"]}
                                     if outcome.get("evidence") else {})}
    judged = "unjudged" if member.get("reference") is None else "in"
    if result == "mismatch" or (result == "fail" and member["fails"] >= config["fail_after"]):
        after = "out"
    elif before == "out":
        after = judged if member["passes"] >= config["pass_after"] else "out"
    else:
        after = judged
    member["verdict"] = after
    if after == before:
        return None
    member["changed_at"] = now
    name = f"{member['donor']} ({member['address']}) for {member['hostname']}"
    if after == "out":
        evidence = outcome.get("evidence") or {}
        return (f"OUT: {name}: {outcome['why']}"
                + (f"; agree {evidence['agree']}, gap {evidence['gap']}, "
                   f"first difference: {evidence['first_difference']}" if evidence else "")
                + f" ({member['fails']} failed in a row)")
    if before == "out":
        return f"BACK IN: {name}: {member['passes']} canaries passed in a row"
    return f"{after.upper()}: {name}: " + (outcome["why"] or "its canary passed")


def run_round(config: dict, post=post_completion, now: float | None = None) -> dict:
    """Ask every member once, save the state, apply Caddy's config when its out-set is not the
    one Caddy last took."""
    now = time.time() if now is None else now
    state = load_state(config["state_dir"])
    context = tls_context(config) if post is post_completion else None
    members, current = state["members"], set()
    for site in config["sites"]:
        for upstream in site["upstreams"]:
            key = member_key(site["hostname"], upstream["donor"])
            current.add(key)
            member = members.setdefault(key, {"hostname": site["hostname"],
                                              "donor": upstream["donor"], "verdict": "in"})
            member["address"] = upstream["address"]
            member["revision"] = upstream.get("revision")
            member["reference"] = (upstream["reference"]["stack"]
                                   if upstream.get("reference") else None)
            outcome = check_member(config, site, upstream, context, post)
            line = update(member, outcome, config, now)
            if line:
                log(line)
    for key in set(members) - current:      # no longer in the inventory
        del members[key]
    state["updated"] = now
    save_state(config["state_dir"], state)
    for site in config["sites"]:
        out = [u["donor"] for u in site["upstreams"]
               if members[member_key(site["hostname"], u["donor"])]["verdict"] == "out"]
        if out and len(out) == len(site["upstreams"]):
            log(f"ALL OUT: every donor of {site['hostname']} ({', '.join(out)}) failed its "
                "canary: the site has no upstream and answers 502 until one passes again")
    # Caddy is told whenever the out-set differs from the one it last took from a round (a load
    # that failed, Caddy down, is tried again at the next round).
    wanted = sorted([hostname, address] for hostname, address in out_members(state))
    if config.get("apply", True) and wanted != state.get("applied"):
        apply(config)
        state["applied"] = wanted
        save_state(config["state_dir"], state)
    return state


# --- Caddy's config ---------------------------------------------------------------------------
def site_hosts(route: dict) -> set[str]:
    return {h for matcher in route.get("match") or [] for h in matcher.get("host") or []}


def _filter(node, out: set[str]) -> bool:
    """Remove the reverse_proxy upstreams dialling `out` under `node`, in place; a proxy left
    with none becomes a 502 (no donor). True when anything was removed."""
    removed = False
    if isinstance(node, dict):
        if node.get("handler") == "reverse_proxy" and isinstance(node.get("upstreams"), list):
            kept = [u for u in node["upstreams"] if u.get("dial") not in out]
            if len(kept) != len(node["upstreams"]):
                removed = True
                if kept:
                    node["upstreams"] = kept
                else:
                    node.clear()
                    node.update({"handler": "static_response", "status_code": 502,
                                 "headers": {"X-Uncloseai-Canary": ["every donor is out"]}})
            return removed
        for value in node.values():
            removed |= _filter(value, out)
    elif isinstance(node, list):
        for value in node:
            removed |= _filter(value, out)
    return removed


def filtered_config(config_json: dict, out: set[tuple[str, str]]) -> dict:
    """Caddy's JSON config (adapted from the deployed Caddyfile) minus the out members: per
    site (a server route matching its hostname), the upstreams dialling their addresses."""
    for server in (config_json.get("apps", {}).get("http", {}).get("servers") or {}).values():
        for route in server.get("routes") or []:
            hosts = site_hosts(route)
            dials = {address for hostname, address in out if hostname in hosts}
            if dials:
                _filter(route, dials)
    return config_json


def adapt(config: dict) -> dict:
    result = subprocess.run([config["caddy"], "adapt", "--adapter", "caddyfile", "--config",
                             config["caddyfile"]], capture_output=True, timeout=ADAPT_TIMEOUT)
    if result.returncode:
        raise RuntimeError(f"caddy adapt {config['caddyfile']}: "
                           f"{result.stderr.decode(errors='replace').strip()[-500:]}")
    return json.loads(result.stdout)


class AdminSocket(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def admin_load(socket_path: str, body: bytes, wait: float = 30) -> None:
    """POST /load on Caddy's admin socket (a graceful config change: requests in flight
    finish). Waits up to `wait` seconds for the socket (Caddy just starting)."""
    deadline = time.monotonic() + wait
    while True:
        connection = AdminSocket(socket_path, ADMIN_TIMEOUT)
        try:
            # Caddy's admin API checks Host against its listen address: none for a socket.
            connection.putrequest("POST", "/load", skip_host=True)
            connection.putheader("Host", "")
            connection.putheader("Content-Type", "application/json")
            # As `caddy reload --force` (the distro unit's reload): loaded even when the JSON is
            # unchanged, so renewed certificate files behind the same paths are read again.
            connection.putheader("Cache-Control", "must-revalidate")
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            said = response.read(4096).decode(errors="replace").strip()
            if response.status != 200:
                raise RuntimeError(f"caddy admin /load: HTTP {response.status}: {said[:500]}")
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        finally:
            connection.close()


def apply(config: dict) -> set[tuple[str, str]]:
    """Load the deployed Caddyfile minus the out members into the running Caddy."""
    out = out_members(load_state(config["state_dir"]))
    body = json.dumps(filtered_config(adapt(config), out)).encode()
    admin_load(config["admin_socket"], body)
    log("caddy: config loaded from " + config["caddyfile"]
        + (f" without {', '.join(sorted(f'{a} ({h})' for h, a in out))}" if out
           else " with every donor"))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("run", "apply"):
        print("usage: edge_canary.py run|apply CONFIG", file=sys.stderr)
        return 2
    config = load_config(argv[1])
    try:
        if argv[0] == "run":
            run_round(config)
        else:
            apply(config)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"edge_canary {argv[0]}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
