"""The edge's canary (files/edge_canary.py): the files the deploy writes to an edge for it, and
the references it compares with (`donors reference` writes them in the operator's data, one per
checkpoint, revision and card stack).

On the edge: the runner and canary.py under <install_root>/canary, its config (sites, members,
knobs, each member's reference) in /etc/uncloseai/canary/canary.json, a oneshot service run by a
timer every `canary.interval`, and a caddy.service drop-in that sends Caddy's reload (and its
start) through the runner's `apply`: no reload brings an out donor back."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import EdgeBox
from donorkit.inventory.paths import REPO_ROOT, operator_path
from donorkit.inventory.values import duration_ns, duration_seconds
from donorkit.render.templates import UNIT_DIR, RenderedFile, edge_paths, jinja_environment

CANARY_SERVICE = "uncloseai-canary.service"
CANARY_TIMER = "uncloseai-canary.timer"
CANARY_DROP_IN = f"{UNIT_DIR}/caddy.service.d/uncloseai-canary.conf"
CANARY_CONFIG = "/etc/uncloseai/canary/canary.json"
# systemd's StateDirectory= of the service: /var/lib/<it>/state.json is who is out.
CANARY_STATE_DIR = "uncloseai-canary"
SYSTEM_PYTHON = "/usr/bin/python3"
CADDY = "/usr/bin/caddy"
# A reference file is the operator's own, small: anything larger is not one.
REFERENCE_LIMIT = 1 << 20


def canary_module() -> ModuleType:
    """files/canary.py (not a package of the install: the edge runs it as a file), loaded once
    as `files.canary`, the name it has when the checkout's root is on the path (bench/)."""
    if "files.canary" not in sys.modules:
        spec = importlib.util.spec_from_file_location("files.canary",
                                                      REPO_ROOT / "files" / "canary.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["files.canary"] = module
        spec.loader.exec_module(module)
    return sys.modules["files.canary"]


class ReferenceError(DonorsError):
    """A reference file in the operator's data is not one (one line)."""


def checkpoint_dir(checkpoint: str) -> str:
    """A checkpoint id as one folder name: `owner/name` -> `owner__name`."""
    return checkpoint.replace("/", "__")


def reference_path(references: Path, checkpoint: str, revision: str, stack: str) -> Path:
    return references / checkpoint_dir(checkpoint) / revision / f"{stack}.json"


def references_dir(data) -> Path:  # an EdgeBox or a DonorBox
    return operator_path(data.canary.references_dir)


def load_reference(path: Path, checkpoint: str, revision: str) -> dict:
    """A reference file, checked: its checkpoint and revision, prompts with tokens and finite
    log-probabilities <= 0 (the operator's own file, but a hand edit must not reach an edge)."""
    def bad(what: str) -> ReferenceError:
        return ReferenceError(f"{path}: {what} (record it again: donors reference)")

    try:
        raw = path.read_bytes()[:REFERENCE_LIMIT + 1]
        doc = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise bad(f"not readable JSON ({type(exc).__name__})") from None
    if len(raw) > REFERENCE_LIMIT or not isinstance(doc, dict):
        raise bad("not a reference")
    if doc.get("checkpoint") != checkpoint or doc.get("revision") != revision:
        raise bad(f"field 'checkpoint'/'revision': not {checkpoint} at {revision}")
    prompts, max_tokens = doc.get("prompts"), doc.get("max_tokens")
    if not isinstance(max_tokens, int) or not 0 < max_tokens <= 256:
        raise bad("field 'max_tokens': not 1 to 256")
    if not isinstance(prompts, list) or not 0 < len(prompts) <= 64:
        raise bad("field 'prompts': not 1 to 64 prompts")
    for n, entry in enumerate(prompts):
        ok = (isinstance(entry, dict) and isinstance(entry.get("prompt"), str)
              and isinstance(entry.get("tokens"), list) and isinstance(entry.get("logprobs"), list)
              and 0 < len(entry["tokens"]) == len(entry["logprobs"]) <= max_tokens
              and all(isinstance(t, str) and len(t) <= 256 for t in entry["tokens"])
              and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and v <= 0 for v in entry["logprobs"]))
        if not ok:
            raise bad(f"field 'prompts[{n}]': not a prompt with tokens and log-probabilities")
    return {"stack": str(doc.get("stack")), "max_tokens": max_tokens,
            "prompts": [{"prompt": e["prompt"], "tokens": e["tokens"], "logprobs": e["logprobs"]}
                        for e in prompts]}


def member_reference(references: Path, checkpoint: str, revision: str | None,
                     stack: str | None) -> dict | None:
    """The reference a member is compared with: its own stack's, else another stack's of the
    same checkpoint and revision (sorted: the same on every run), else None (unjudged)."""
    if not revision:
        return None
    folder = references / checkpoint_dir(checkpoint) / revision
    own = folder / f"{stack}.json"
    found = [own] if own.is_file() else sorted(folder.glob("*.json")) if folder.is_dir() else []
    return load_reference(found[0], checkpoint, revision) if found else None


def member(references: Path, knobs, checkpoint: str, upstream) -> dict:
    """A pool member as the runner judges it: its reference and the gap it may be from it (its
    own stack's bound, or the wider one when only another stack's reference exists)."""
    reference = member_reference(references, checkpoint, upstream.revision, upstream.stack)
    own = reference is not None and reference_path(
        references, checkpoint, upstream.revision, upstream.stack).is_file()
    return {"donor": upstream.donor, "address": upstream.address, "revision": upstream.revision,
            "reference": reference, "max_logprob_gap": knobs.max_logprob_gap if own
            else knobs.max_logprob_gap_other_stack}


def canary_config(data: EdgeBox) -> dict:
    references = references_dir(data)
    knobs = data.canary
    return {
        "caddy": CADDY, "caddyfile": "/etc/caddy/Caddyfile",
        "admin_socket": data.caddy_admin_socket, "state_dir": f"/var/lib/{CANARY_STATE_DIR}",
        **{key: edge_paths(data)[key] for key in ("ca", "client_cert", "client_key")},
        "timeout": duration_seconds(knobs.timeout), "fail_after": knobs.fail_after,
        "pass_after": knobs.pass_after, "window": knobs.window, "min_agree": knobs.min_agree,
        "max_logprob_gap": knobs.max_logprob_gap,
        "sites": [{"hostname": site.hostname, "checkpoint": site.checkpoint, "upstreams": [
            member(references, knobs, site.checkpoint, u) for u in site.upstreams]}
            for site in data.sites],
    }


def systemd_time(duration: str) -> str:
    """A Caddy duration as systemd reads it, in milliseconds (one unit, no ambiguity)."""
    return f"{max(duration_ns(duration) // 10**6, 1)}ms"


def render_canary(data: EdgeBox) -> list[RenderedFile]:
    """Every file the deploy writes to an edge for its canary (tasks/edge_canary.py)."""
    runner_dir = f"{data.install_root}/canary"
    runner = f"{runner_dir}/edge_canary.py"
    config = canary_config(data)
    members = sum(len(site.upstreams) for site in data.sites)
    prompts = max([len(u["reference"]["prompts"]) for s in config["sites"]
                   for u in s["upstreams"] if u["reference"]] or [6])
    # A round asks each member each prompt, one at a time, each within `timeout`.
    round_s = math.ceil(members * prompts * config["timeout"]) + 120
    # The runner's two commands as words: the template quotes them (systemd_command).
    command = [SYSTEM_PYTHON, "-I", "-S", runner]
    values = dict(run=[*command, "run", CANARY_CONFIG], apply=[*command, "apply", CANARY_CONFIG],
                  state_dir=CANARY_STATE_DIR, interval=systemd_time(data.canary.interval),
                  round_s=round_s, service=CANARY_SERVICE, edge_name=data.edge_name)
    env = jinja_environment()
    return [
        RenderedFile(f"{runner_dir}/canary.py", (REPO_ROOT / "files/canary.py").read_text()),
        RenderedFile(runner, (REPO_ROOT / "files/edge_canary.py").read_text()),
        RenderedFile(CANARY_CONFIG, json.dumps(config, indent=1, sort_keys=True) + "\n"),
        RenderedFile(f"{UNIT_DIR}/{CANARY_SERVICE}",
                     env.get_template("canary.service.j2").render(values)),
        RenderedFile(f"{UNIT_DIR}/{CANARY_TIMER}",
                     env.get_template("canary.timer.j2").render(values)),
        RenderedFile(CANARY_DROP_IN, env.get_template("caddy-canary.conf.j2").render(values)),
    ]
