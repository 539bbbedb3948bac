"""Putting a model into service: its weights fetched ahead (files/fetch_weights.py, as the service
user) and the readiness gate after a unit (re)starts (files/wait_ready.py). Both programs run
long and print progress: their output is shown in the run as it comes, whatever pyinfra's
verbosity (a FunctionCommand running the command with print_output)."""

from __future__ import annotations

import json
import re
import shlex

from pyinfra import host
from pyinfra.api import FactBase, FunctionCommand, StringCommand

from donorkit.render.templates import hf_home
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote
COMMIT = re.compile(r"[0-9a-f]{40}")  # whole strings only: COMMIT.fullmatch


def hf_token_path(install_root: str) -> str:
    """Where a box keeps the Hugging Face token: root's, 0600, in a 0700 folder of root's (the
    service user, and so every vLLM unit, cannot open it; the weights step hands it over)."""
    return f"{install_root}/secrets/hf-token"


def home_token_path(home: str) -> str:
    """Where deploys before issue 21 kept it, readable by the service user: removed."""
    return f"{home}/.config/uncloseai/hf-token"


def manifest_dir(home: str) -> str:
    """Where fetch_weights.py records complete fetches (outside the hub cache's own layout)."""
    return f"{home}/.cache/uncloseai/weights"


class WeightsComplete(FactBase):
    """Whether the snapshot of `repo` at `revision` is complete in the cache: the fetcher's own
    cheap check (its manifest and a stat of each file; no network, no hashing). False when the
    fetcher or the venv is not there yet."""

    def command(self, python: str, script: str, repo: str, revision: str, cache_dir: str,
                manifests: str) -> str:
        # As root: -S, no site-packages (the check is the standard library's only), -I, nothing
        # from the environment, the user's site or the working folder.
        return (f"[ -x {q(python)} ] && [ -f {q(script)} ] && {q(python)} -I -S {q(script)} "
                "--check "
                f"--repo {q(repo)} --revision {q(revision)} --cache-dir {q(cache_dir)} "
                f"--manifest-dir {q(manifests)} 2>/dev/null || true")

    def process(self, output: list[str]) -> bool:
        return any(": complete (" in line for line in output)

    def default(self) -> bool:
        return False


class ModelsListed(FactBase):
    """The ids `/v1/models` lists on a loopback port; None when nothing answers there."""

    def command(self, port: int) -> str:
        # curl prints the JSON without a final newline: the `echo` ends the line, or the
        # snapshot's section marker would be glued to it (and the section lost).
        return (f"curl -sf --max-time 3 http://127.0.0.1:{int(port)}/v1/models 2>/dev/null; "
                "echo")

    def process(self, output: list[str]) -> list[str] | None:
        try:
            return [m.get("id") for m in json.loads("\n".join(output).strip()).get("data", [])]
        except (ValueError, AttributeError):
            return None

    def default(self) -> None:
        return None


def streamed(state, host, command: str) -> bool:
    """Run `command` on the host with its output shown line by line as it comes."""
    status, _ = host.run_shell_command(StringCommand(command), print_output=True,
                                       _sudo=bool(host.data.get("_sudo")))
    return status


@operation(complete=lambda op: None if op.repo.startswith("/") or not COMMIT.fullmatch(
        op.revision or "") else need(
    WeightsComplete, python=op.python, script=op.script, repo=op.repo, revision=op.revision,
    cache_dir=op.cache_dir, manifests=op.manifests))
def model_weights(model: str, repo: str, revision: str | None, python: str, script: str,
                  service_user: str, home: str, cache_dir: str, manifests: str, endpoint: str,
                  token_file: str | None, complete: bool | None, token_error: str | None = None):
    """The checkpoint at its pinned revision, complete in the service user's cache."""
    if repo.startswith("/"):
        host.noop(f"{repo} is a path on the box: nothing to fetch")
        return
    if token_error:
        fail(token_error)
    if revision is None:
        fail(f"models.{model}.revision is not set: pin the commit of {repo} (40 hex, the "
             "hub's 'Files and versions' history) in inventory/defaults.yml or the donor's "
             "overrides")
    if complete:
        host.noop(f"{repo}@{revision[:12]} complete in {cache_dir}")
        return
    # From /, with the service user's own HOME: nothing of root's is looked at.
    command = (f"cd / && runuser -u {q(service_user)} -- env HOME={q(home)} "
               f"HF_HOME={q(hf_home(home))} {q(python)} {q(script)} "
               f"--repo {q(repo)} --revision {q(revision)} --cache-dir {q(cache_dir)} "
               f"--manifest-dir {q(manifests)} --endpoint {q(endpoint)}")
    if token_file:
        # Root's file (tasks/weights.py), opened by this root shell before runuser: the fetch
        # reads the token on stdin; the service user (vLLM's) cannot open the file itself.
        command += f" --token-stdin < {q(token_file)}"
    yield FunctionCommand(streamed, (command,), {})


@operation(listed=lambda op: need(ModelsListed, port=op.port))
def ready_gate(unit: str, port: int, checkpoint: str, python: str, script: str,
               timeout: float, journal_lines: int, listed: list[str] | None):
    """After a (re)start, or whenever the model is not listed: wait until it is, or fail with
    the unit's journal. The gate runs as root: `python` is the system's interpreter, run with
    -I -S (nothing from the environment, a user's site, the working folder or site-packages)."""
    if listed and checkpoint in listed:
        host.noop(f"{unit} lists {checkpoint}")
        return
    yield FunctionCommand(streamed, (
        f"{q(python)} -I -S {q(script)} --unit {q(unit)} --port {int(port)} "
        f"--model {q(checkpoint)} --timeout {float(timeout):g} "
        f"--journal-lines {int(journal_lines)}",), {})
