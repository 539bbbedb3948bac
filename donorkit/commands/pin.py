"""`donors pin [--branch main] [--all]`: pin every served model's checkpoint to a commit.

    .venv/bin/python -m donorkit.commands.pin [--branch main] [--all] [--donors FILE]

Asks the Hugging Face hub (the profile's `hf_endpoint`) which 40-hex commit the branch points to
(model_info) and writes it as `revision:` into the file that defines the profile, keeping its
comments and layout (set_revision); prints `old -> new`. Nothing is written unless every lookup
succeeded: a guessed revision would be worse than none.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

import yaml

from donorkit.box.serving import COMMIT
from donorkit.commands.transport import capped_transport, shown, within
from donorkit.inventory.errors import DonorsError
from donorkit.inventory.fleet import (
    DEFAULTS_FILE,
    FleetError,
    load_inventory,
    read_yaml,
    token_file_problem,
)
from donorkit.inventory.paths import REPO_ROOT, donors_file, operator_path
from donorkit.inventory.schema import deep_merge

# The most a hub's answer about one repository may be, in bytes (model info with its list of
# files: a few KiB for a model's repository).
HUB_ANSWER_LIMIT = 512 << 10


class LockError(DonorsError):
    """One line to print: what could not be resolved or written, and why."""


class OffHub(Exception):
    """The hub redirected the lookup to another origin: not followed."""


@dataclass
class Pin:
    """One `models.<name>` mapping in one file, and what it resolves to."""

    file: Path
    path: tuple[str, ...]                 # keys down to the model's mapping
    checkpoint: str
    endpoint: str
    token_file: str | None
    old: str | None
    users: list[str] = field(default_factory=list)   # donors served by it
    new: str | None = None

    @property
    def where(self) -> str:
        file = self.file.resolve()
        shown = file.relative_to(REPO_ROOT) if file.is_relative_to(REPO_ROOT) else file
        return f"{shown}: {'.'.join(self.path)}"


def _get(doc: object, path: tuple[str, ...]) -> object:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def _scope(doc: dict, defaults: dict, donor: str | None, model: str,
           donors_path: Path, defaults_path: Path) -> tuple[Path, tuple[str, ...]]:
    """The deepest mapping that sets this model's checkpoint or revision: where a revision
    written takes effect for the checkpoint it was resolved for."""
    candidates = []
    if donor is not None:
        candidates.append((donors_path, ("donors", donor, "overrides", "models", model)))
    candidates += [(donors_path, ("overrides", "models", model)),
                   (defaults_path, ("models", model))]
    for file, path in candidates:
        source = defaults if file == defaults_path and path[0] == "models" else doc
        node = _get(source, path)
        if isinstance(node, dict) and ("checkpoint" in node or "revision" in node):
            return file, path
    return defaults_path, ("models", model)


def plan(donors_path: Path | str | None = None, defaults_path: Path | str | None = None,
         every_profile: bool = False) -> list[Pin]:
    """The pins to resolve, one per (file, model mapping); FleetError on a bad inventory."""
    fleet, _ = load_inventory(donors_path, defaults_path)
    donors_path = Path(donors_path or donors_file())
    defaults_path = Path(defaults_path or DEFAULTS_FILE)
    doc, defaults = read_yaml(donors_path), read_yaml(defaults_path)
    pins: dict[tuple[Path, tuple[str, ...]], Pin] = {}
    for name, box in fleet.items():
        for model, profile in box.models.items():
            if profile.checkpoint.startswith("/"):
                continue  # a path on the box: nothing to resolve
            file, path = _scope(doc, defaults, name, model, donors_path, defaults_path)
            pin = pins.setdefault((file, path), Pin(
                file, path, profile.checkpoint, box.hf_endpoint, box.hf_token_file,
                profile.revision))
            if pin.checkpoint != profile.checkpoint:
                raise FleetError(f"{pin.where}: donors {', '.join(pin.users)} and {name} read "
                                 "this revision for different checkpoints: set each donor's "
                                 "checkpoint and revision together in its overrides")
            pin.users.append(name)
    if every_profile:
        settings = _file_wide(doc, defaults)
        for model, profile in settings["models"].items():
            if profile.get("checkpoint", "").startswith("/"):
                continue
            file, path = _scope(doc, defaults, None, model, donors_path, defaults_path)
            pins.setdefault((file, path), Pin(
                file, path, profile["checkpoint"], settings["hf_endpoint"],
                settings.get("hf_token_file"), profile.get("revision")))
    return list(pins.values())


def _file_wide(doc: dict, defaults: dict) -> dict:
    return deep_merge(defaults, doc.get("overrides") or {})


def resolve(pins: list[Pin], branch: str, timeout: float = 20) -> list[str]:
    """Each pin's commit at `branch` (pin.new), from its hub; the problems, one line each."""
    problems, seen = [], {}
    for pin in pins:
        key = (pin.endpoint, pin.checkpoint, pin.token_file)
        if key not in seen:
            try:
                seen[key] = _commit(pin, branch, timeout)
            except LockError as exc:
                seen[key] = exc
        result = seen[key]
        if isinstance(result, LockError):
            problems.append(f"{pin.where}: {result}")
        else:
            pin.new = result
    return problems


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def model_info(endpoint: str, checkpoint: str, revision: str, token: str | None,
               timeout: float) -> dict:
    """The hub's answer about `checkpoint` at `revision`, as HfApi.model_info asks for it (its
    path, huggingface_hub's headers and errors: RepositoryNotFoundError, RevisionNotFoundError,
    ...), through a client that follows redirects on the hub's origin only (OffHub), reads at
    most HUB_ANSWER_LIMIT bytes and gives up `timeout` seconds after it started."""
    import httpx2
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    hub = _origin(endpoint)
    url = (f"{endpoint.rstrip('/')}/api/models/{checkpoint}/revision/"
           f"{quote(revision, safe='')}")

    def on_the_hub(request: httpx2.Request) -> None:
        if _origin(str(request.url)) != hub:
            raise OffHub(f"the hub redirected to {shown(str(request.url), 120)}, not "
                         f"{endpoint}: not followed")

    def ask() -> dict:
        with httpx2.Client(transport=capped_transport(timeout, HUB_ANSWER_LIMIT),
                           follow_redirects=True, timeout=timeout,
                           event_hooks={"request": [on_the_hub]}) as client:
            response = client.get(url, headers=build_hf_headers(token=token))
            hf_raise_for_status(response)
            data = response.json()
        if not isinstance(data, dict):
            raise ValueError("the answer is not a JSON object")
        return data

    return within(timeout, url, ask)


def _commit(pin: Pin, branch: str, timeout: float) -> str:
    token = None
    if pin.token_file:
        problem = token_file_problem(pin.token_file)
        if problem:
            raise LockError(f"hf_token_file: {problem}")
        try:
            token = operator_path(pin.token_file).read_text().strip()
        except OSError as exc:
            raise LockError(f"hf_token_file {pin.token_file}: {exc.strerror}") from None
    try:
        info = model_info(pin.endpoint, pin.checkpoint, branch, token, timeout)
    except Exception as exc:  # noqa: BLE001 - every way of not getting an answer: one line
        cause = shown(f"{type(exc).__name__}: {exc}".splitlines()[0], 300)
        raise LockError(f"{pin.checkpoint} @ {branch} from {pin.endpoint}: {cause}; nothing "
                        "written") from None
    sha = info.get("sha")
    if not isinstance(sha, str) or not COMMIT.fullmatch(sha):
        raise LockError(f"{pin.checkpoint} @ {branch} from {pin.endpoint}: the hub answered no "
                        f"40-hex commit ({shown(repr(sha), 80)}); nothing written")
    return sha


_KEY = re.compile(r"""^(?P<key>"[^"]*"|'[^']*'|[^\s:#][^:#]*?)\s*:(?:\s+(?P<rest>.*))?$""")


def _block(lines: list[str], path: tuple[str, ...], where: str) -> tuple[int, int, int]:
    """(first line, end line, indentation of the children) of the mapping at `path`, written in
    block style; LockError otherwise."""
    start, end, indent = 0, len(lines), -1
    for depth, key in enumerate(path):
        found, child = None, None
        for i in range(start, end):
            text = lines[i].rstrip("\n")
            body = text.lstrip(" ")
            if not body.strip() or body.startswith("#"):
                continue
            ind = len(text) - len(body)
            if ind <= indent:
                break
            child = ind if child is None else child
            match = _KEY.match(body)
            if ind == child and match and match.group("key").strip("\"'") == key:
                rest = (match.group("rest") or "").split(" #")[0].strip()
                if rest and not rest.startswith("#"):
                    raise LockError(f"{where}: '{'.'.join(path[:depth + 1])}' is written on one "
                                    "line (flow style): write the revision there by hand")
                found = i
                break
        if found is None:
            raise LockError(f"{where}: '{'.'.join(path[:depth + 1])}' not found as a block "
                            "mapping: write the revision there by hand")
        j = found + 1
        while j < end:
            text = lines[j].rstrip("\n")
            body = text.lstrip(" ")
            if body.strip() and not body.startswith("#") and len(text) - len(body) <= child:
                break
            j += 1
        start, end, indent = found + 1, j, child
    return start, end, indent


def set_revision(text: str, path: tuple[str, ...], sha: str, where: str) -> str:
    """`text` with `revision: sha` in the mapping at `path` (replaced, or added after its
    `checkpoint:` line); comments and layout kept. Checked by parsing both: exactly that value
    changed."""
    lines = text.splitlines(keepends=True)
    start, end, parent = _block(lines, path, where)
    child = None
    target = None
    for i in range(start, end):
        body = lines[i].lstrip(" ")
        if not body.strip() or body.startswith("#"):
            continue
        ind = len(lines[i]) - len(body)
        child = ind if child is None else child
        match = _KEY.match(body.rstrip("\n"))
        if ind == child and match and match.group("key") == "revision":
            target = i
            break
    pad = " " * (child if child is not None else parent + 2)
    if target is not None:
        comment = ""
        rest = _KEY.match(lines[target].lstrip(" ").rstrip("\n")).group("rest") or ""
        if " #" in f" {rest}":
            comment = "  #" + f" {rest}".split(" #", 1)[1]
        lines[target] = f"{pad}revision: {sha}{comment}\n"
    else:
        after = next((i for i in range(start, end)
                      if lines[i].lstrip(" ").startswith("checkpoint:")), start - 1)
        lines.insert(after + 1, f"{pad}revision: {sha}\n")
    new = "".join(lines)
    before, got = yaml.safe_load(text), yaml.safe_load(new)
    expected = before
    node = expected
    for key in path:
        node = node[key]
    node["revision"] = sha
    if got != expected:
        raise LockError(f"{where}: could not write the revision safely: set it by hand to {sha}")
    return new


def write(pins: list[Pin]) -> None:
    """Every changed pin into its file; all files checked before any is written."""
    texts: dict[Path, str] = {}
    for pin in pins:
        if pin.new and pin.new != pin.old:
            text = texts.get(pin.file) or pin.file.read_text()
            texts[pin.file] = set_revision(text, pin.path, pin.new, pin.where)
    for file, text in texts.items():
        tmp = file.with_name(f".{file.name}.lock-tmp")
        tmp.write_text(text)
        tmp.replace(file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make lock", description=__doc__.splitlines()[0])
    parser.add_argument("--branch", default="main", help="the branch (or tag) to pin (main)")
    parser.add_argument("--all", action="store_true",
                        help="every model profile, also those no donor serves")
    parser.add_argument("--donors", help="donors file (default: $DONORS_FILE or "
                                         "inventory/donors.yml)")
    parser.add_argument("--defaults", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds for each lookup, its whole answer included (20)")
    args = parser.parse_args(argv)
    try:
        pins = plan(args.donors, args.defaults, args.all)
    except FleetError as exc:
        print(f"lock: inventory error: {exc}", file=sys.stderr)
        return 2
    problems = resolve(pins, args.branch, args.timeout)
    if problems:
        for problem in problems:
            print(f"lock: REFUSED {problem}", file=sys.stderr)
        return 1
    try:
        write(pins)
    except (LockError, OSError) as exc:
        print(f"lock: REFUSED {exc}", file=sys.stderr)
        return 1
    for pin in pins:
        change = "unchanged" if pin.new == pin.old else f"{pin.old or 'none'} -> {pin.new}"
        users = f" (served by {', '.join(pin.users)})" if pin.users else " (no donor serves it)"
        print(f"lock: {pin.where}: {pin.checkpoint} @ {args.branch}: {change}{users}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
