"""`donors reference [--limit P]`: the canaries' reference, recorded on the boxes the operator
trusts (owner: operator and cache_builder: true, as for the kernel and wheel caches): for each
model a builder serves, files/canary.py's prompts are sent to the box's Caddy as an edge reaches
it (the model's public hostname as SNI and Host, our CA, the operator's client certificate), and
each answer (parse_answer: bounded and checked) is kept with its tokens and log-probabilities in
the operator's data: <canary.references_dir>/<owner__name>/<revision>/<stack>.json. A second run
replaces a file atomically. The deploy ships each edge the references of what it serves
(donorkit/render/canary_files.py); the edge compares every donor's canaries with them.

Refused, one line, before any box is touched: a --limit naming a box that is not a trusted
builder, a model without a pinned revision. Refused after asking: an answer naming another model.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from donorkit.commands.transport import PinnedHTTPS, client_context, pinned_request, shown
from donorkit.inventory import errors
from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import DonorBox, ServedModel
from donorkit.inventory.paths import donors_file, pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki, PkiError
from donorkit.render.canary_files import canary_module, reference_path, references_dir

canary = canary_module()  # files/canary.py: the one copy the edge runs too


class NotTrusted(DonorsError):
    """A box the operator does not trust as a reference (one line)."""


class ReferenceFailed(DonorsError):
    """A builder's answers could not become a reference (one line)."""

    exit_code = errors.FAILED


def trusted(box: DonorBox) -> bool:
    return box.owner == "operator" and box.cache_builder


def builders(fleet: dict[str, DonorBox], limited: bool) -> dict[str, DonorBox]:
    """The trusted builders to record on; with --limit every selected donor must be one. Each
    served model must be pinned. Raised before any box is touched."""
    where = donors_file()
    if limited:
        for name, box in fleet.items():
            if not trusted(box):
                raise NotTrusted(
                    f"{where}: donor '{name}': field 'cache_builder': not a box the operator "
                    f"trusts (owner: {box.owner}, cache_builder: {str(box.cache_builder).lower()})"
                    ": a reference comes from an operator's cache builder only")
    chosen = {name: box for name, box in fleet.items() if trusted(box)}
    if not chosen:
        raise NotTrusted(f"{where}: no donor is a trusted builder (owner: operator and "
                         "cache_builder: true): no box to record a reference on")
    for name, box in chosen.items():
        for key, model in box.models.items():
            if not model.revision:
                raise NotTrusted(f"{where}: donor '{name}': field 'models.{key}.revision': "
                                 f"{model.checkpoint} is not pinned (donors pin): a reference "
                                 "is recorded for one revision")
    return chosen


def ask(box: DonorBox, hostname: str, body: bytes, client: tuple[str, str],
        timeout: float) -> tuple[int, bytes]:
    connection = PinnedHTTPS(box.ssh_hostname, box.caddy_https_port, hostname,
                             client_context(pki_dir(box) / "ca.crt", client), timeout,
                             box.caddy_proxy_command)
    try:
        return pinned_request(connection, "POST", "/v1/completions",
                              {"Content-Type": "application/json"}, body,
                              canary.ANSWER_LIMIT + 1)
    finally:
        connection.close()


def record(name: str, box: DonorBox, model: ServedModel, hostname: str,
           timeout: float) -> dict:
    """The reference document of `model` as `box` serves it (ReferenceFailed: one line)."""
    try:
        pair = Pki(pki_dir(box)).client_pair(OPERATOR_CLIENT)
    except PkiError as exc:
        raise ReferenceFailed(f"{name}: {errors.one_line(exc)}") from None
    client = (str(pair[0]), str(pair[1]))
    prompts = []
    for prompt in canary.PROMPTS:
        body = canary.request_body(model.checkpoint, prompt)
        try:
            status, raw = ask(box, hostname, body, client, timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise ReferenceFailed(shown(f"{name}: {hostname}: {type(exc).__name__}: {exc}",
                                        300)) from None
        if status != 200:
            raise ReferenceFailed(f"{name}: {hostname}: /v1/completions answered HTTP {status}")
        try:
            answer = canary.parse_answer(raw)
        except canary.BadAnswer as exc:
            raise ReferenceFailed(f"{name}: {hostname}: {exc}") from None
        if answer.model != model.checkpoint:
            raise ReferenceFailed(shown(f"{name}: {hostname}: the answer names model "
                                        f"{answer.model!r}, not {model.checkpoint}: no "
                                        "reference written", 300))
        prompts.append({"prompt": prompt, "tokens": list(answer.tokens),
                        "logprobs": list(answer.logprobs)})
    return {"checkpoint": model.checkpoint, "revision": model.revision,
            "stack": box.canary_stack(model.name), "built_by": name,
            "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "max_tokens": canary.MAX_TOKENS, "prompts": prompts}


def write(path: Path, doc: dict) -> None:
    """Atomically: the edge's deploy reads the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(doc, handle, indent=1)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(fleet: dict[str, DonorBox], limited: bool, timeout: float = 60) -> int:
    chosen = builders(fleet, limited)
    failed = []
    for name, box in chosen.items():
        hostnames = {}
        for route in box.routes:
            hostnames.setdefault(route.model, route.hostname)
        for key, model in box.models.items():
            try:
                doc = record(name, box, model, hostnames[key], timeout)
            except ReferenceFailed as exc:
                print(f"donors: {exc}", file=sys.stderr)
                failed.append(name)
                continue
            path = reference_path(references_dir(box), model.checkpoint, model.revision,
                                  box.canary_stack(key))
            write(path, doc)
            print(f"reference: {path} ({model.checkpoint} at {model.revision[:12]}, "
                  f"{box.canary_stack(key)}, from {name})")
    return errors.FAILED if failed else errors.OK
