"""Fetch one model checkpoint at a pinned revision into the service user's Hugging Face cache.

Run on the box by the deploy AS THE SERVICE USER with the vLLM venv's python (huggingface_hub is
a vLLM dependency). Converged (check, `--check`): a manifest of an earlier complete fetch and
every listed file in the snapshot with its size, no network. Otherwise the real client,
`snapshot_download`, fetches what is missing (resumed, earlier files kept), printing progress.
The token comes on stdin or from a 0600 file of this user, never printed; a hostile hub cannot
place files outside the model's cache (refuse_unsafe_names, unsafe_listing, escaped_files).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import stat
import sys
import threading
import time
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What the hub sends as a file's ETag: its git blob id (sha1) or, for LFS/Xet files, its sha256.
# The client uses it as a file name under blobs/: anything else is refused before it is used.
BLOB_ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


class Refused(Exception):
    """One line for the operator; exit status 2."""


def repo_folder(cache_dir: Path, repo: str) -> Path:
    # huggingface_hub's cache layout: models--<org>--<name>/{blobs,snapshots/<commit>,refs}
    return cache_dir / ("models--" + repo.replace("/", "--"))


def manifest_path(manifest_dir: Path, repo: str, revision: str) -> Path:
    return manifest_dir / ("models--" + repo.replace("/", "--")) / f"{revision}.json"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def missing_files(snapshot: Path, files: dict[str, int]) -> list[str]:
    """Files of the listing not in the snapshot with their size (stat follows the blob link)."""
    missing = []
    for path, size in files.items():
        try:
            if (snapshot / path).stat().st_size != size:
                missing.append(path)
        except OSError:
            missing.append(path)
    return missing


def escaped_files(folder: Path, revision: str, files) -> list[str]:
    """`path -> where it resolves` for each listed file of the snapshot that is not inside the
    model's cache: its blobs/ (the client's links) or the snapshot itself (a copy where links are
    not made). A hostile ETag or listing, or a planted link, shows here."""
    snapshot = folder / "snapshots" / revision
    real = folder.resolve()  # the blobs/ and snapshot folders themselves may not be links out
    inside = [real / "blobs", real / "snapshots" / revision]
    escaped = []
    for path in files:
        entry = snapshot / path
        if not entry.exists() and not entry.is_symlink():
            continue  # missing: missing_files says so
        where = entry.resolve()
        if not any(where.is_relative_to(d) and where != d for d in inside):
            escaped.append(f"{path} -> {where}")
    return escaped


def unsafe_listing(files) -> list[str]:
    """Listed paths that would not stay inside the snapshot folder."""
    return [p for p in files if p.startswith("/") or "\\" in p
            or any(part in ("", ".", "..") for part in p.split("/"))]


def check(args) -> tuple[bool, str]:
    """Converged = a manifest written by an earlier complete fetch (the file list and sizes at that
    revision) and every listed file present in the cache's `snapshots/<revision>/` with that size,
    inside the model's own cache: a directory listing, no network, no hashing."""
    manifest = manifest_path(args.manifest_dir, args.repo, args.revision)
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False, "no record of a complete fetch"
    if recorded.get("repo") != args.repo or recorded.get("revision") != args.revision:
        return False, f"{manifest} is for another checkpoint"
    files = recorded["files"]
    snapshot = repo_folder(args.cache_dir, args.repo) / "snapshots" / args.revision
    missing = missing_files(snapshot, files)
    if missing:
        return False, f"{len(missing)} of {len(files)} files missing or short ({missing[0]} ...)"
    escaped = escaped_files(repo_folder(args.cache_dir, args.repo), args.revision, files)
    if escaped:
        return False, f"outside the cache: {escaped[0]}"
    return True, f"{len(files)} files, {human(sum(files.values()))}"


def read_token(path: Path | None, stdin: bool = False) -> str | None:
    """The token, when configured: from standard input (`--token-stdin`: the deploy opens the
    root-owned file and hands it over; nothing this user runs can read it) or from a file that
    must be 0600 and owned by this user. Never printed."""
    if stdin:
        token = sys.stdin.readline().strip()
        if not token:
            raise Refused("--token-stdin: no token on standard input")
        return token
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError as e:
        raise Refused(f"token file {path}: {e.strerror}") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise Refused(f"token file {path} must be mode 0600 "
                      f"(is {stat.S_IMODE(st.st_mode):04o})")
    if st.st_uid != os.geteuid():
        raise Refused(f"token file {path} must be owned by the user that fetches")
    token = path.read_text().strip()
    if not token:
        raise Refused(f"token file {path} is empty")
    return token


class UnsafeAnswer(Exception):
    """A hub answer whose headers would name a file outside the cache."""


def refuse_unsafe_names(response) -> None:
    """httpx response hook (huggingface_hub's public `set_client_factory`): on a file's resolve
    answer, the ETag the client will name the blob after (X-Linked-Etag, else ETag, as the client
    reads them) must be a plain hash, and X-Repo-Commit a commit. Raised before the client reads
    the headers, so nothing is written under a name the server chose."""
    if "/resolve/" not in response.request.url.path:
        return
    headers = response.headers
    etag = headers.get("X-Linked-Etag") or headers.get("ETag")
    if etag is not None:
        plain = etag.removeprefix("W/").strip('"')
        if not BLOB_ETAG.fullmatch(plain):
            name = response.request.url.path.split("/resolve/", 1)[1].split("/", 1)[-1]
            raise UnsafeAnswer(f"{name}: "
                               f"ETag {etag!r} is not a hash (the client would name the file "
                               "after it)")
    commit = headers.get("X-Repo-Commit")
    if commit is not None and not COMMIT.fullmatch(commit):
        raise UnsafeAnswer(f"{response.request.url.path}: X-Repo-Commit {commit!r} is not a "
                           "commit hash")


def install_answer_check(huggingface_hub) -> None:
    """refuse_unsafe_names on every response of the client's shared HTTP client (public API:
    `get_session()` and httpx's `event_hooks`). Should the client ever replace that session, the
    check after the download still names any file that landed outside."""
    session = huggingface_hub.get_session()
    hooks = getattr(session, "event_hooks", None)  # httpx clients (huggingface_hub >= 1.0)
    if not isinstance(hooks, dict):
        print(f"weights: huggingface_hub {huggingface_hub.__version__}'s session takes no "
              "response hook: only the check after the download guards the cache", flush=True)
        return
    session.event_hooks = {**hooks, "response": [*hooks.get("response", []),
                                                 refuse_unsafe_names]}


class Progress:
    """Prints files done, bytes on disk and the rate, from the cache folder itself (so it needs
    nothing from the client's internals): finished files are snapshot entries of the listing,
    bytes in flight are the blobs' `*.incomplete` files."""

    def __init__(self, folder: Path, revision: str, files: dict[str, int], interval: float):
        self.snapshot = folder / "snapshots" / revision
        self.blobs = folder / "blobs"
        self.files = files
        self.total = sum(files.values())
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def measure(self) -> tuple[int, int]:
        done = [p for p, size in self.files.items() if not missing_files(self.snapshot,
                                                                         {p: size})]
        partial = 0
        for part in self.blobs.glob("*.incomplete"):
            try:
                partial += part.stat().st_size
            except OSError:
                pass
        return len(done), sum(self.files[p] for p in done) + partial

    def line(self, done: int, have: int, rate: float | None) -> str:
        text = f"weights: {done}/{len(self.files)} files, {human(have)} of {human(self.total)}"
        return text + (f", {human(rate)}/s" if rate is not None else "")

    def _run(self) -> None:
        last_t, last_b = time.monotonic(), self.measure()[1]
        while not self.stop.wait(self.interval):
            done, have = self.measure()
            now = time.monotonic()
            print(self.line(done, have, max(have - last_b, 0) / (now - last_t)), flush=True)
            last_t, last_b = now, have


def remove_orphans(folder: Path) -> None:
    """Partial files left by a killed run (the client names them per process and removes them
    itself on any error it sees, so one still here while we hold the lock is an orphan)."""
    for part in (folder / "blobs").glob("*.incomplete"):
        size = part.stat().st_size
        part.unlink(missing_ok=True)
        print(f"weights: removed {part.name} ({human(size)}), left by an interrupted run",
              flush=True)


def fetch(args) -> None:
    """The files still missing, with `huggingface_hub.snapshot_download`: an interrupted
    connection is resumed by the client itself (HTTP Range); files finished by an earlier, killed
    run are kept and not fetched again; progress (files, bytes, rate) every few seconds."""
    token = read_token(args.token_file, args.token_stdin)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # The client's own bars redraw with carriage returns: useless in a deploy log. Ours print lines.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.pop("HF_HUB_OFFLINE", None)
    if args.endpoint:
        os.environ["HF_ENDPOINT"] = args.endpoint
    try:
        import huggingface_hub
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.hf_api import RepoFile
    except ImportError as e:
        raise Refused(f"huggingface_hub is not importable by {sys.executable}: {e}") from None
    install_answer_check(huggingface_hub)

    folder = repo_folder(args.cache_dir, args.repo)
    endpoint = args.endpoint or huggingface_hub.constants.ENDPOINT
    where = f"{args.repo}@{args.revision} from {endpoint}"
    try:
        listing = {f.path: f.size for f in HfApi(endpoint=args.endpoint, token=token)
                   .list_repo_tree(args.repo, revision=args.revision, recursive=True)
                   if isinstance(f, RepoFile)}
        if not listing:
            raise Refused(f"{where}: the revision lists no files")
        unsafe = unsafe_listing(listing)
        if unsafe:
            raise Refused(f"{where}: the listing names a path outside the snapshot: "
                          f"{unsafe[0]!r}")
        progress = Progress(folder, args.revision, listing, args.progress_interval)
        done, have = progress.measure()
        print(f"weights: fetching {where}: {len(listing)} files, {human(progress.total)}; "
              f"{done} files ({human(have)}) already here (huggingface_hub "
              f"{huggingface_hub.__version__})", flush=True)
        started = time.monotonic()
        progress.thread.start()
        try:
            snapshot_download(args.repo, revision=args.revision, cache_dir=args.cache_dir,
                              endpoint=args.endpoint, token=token, max_workers=args.workers)
        finally:
            progress.stop.set()
    except Refused:
        raise
    except (HfHubHTTPError, OSError, ValueError) as e:
        message = str(e).splitlines()[0] if str(e) else ""
        if token:
            message = message.replace(token, "***")
        elif type(e).__name__ == "GatedRepoError":
            message += (" (fetched without a token: the model needs `gated: true` and "
                        "hf_token_file, on an operator-owned box only; a volunteer's box gets "
                        "no token)")
        raise Refused(f"{where}: {type(e).__name__}: {message}") from None
    except Exception as e:  # the client's transport errors (httpx) have no common public base
        message = (str(e).splitlines() or [""])[0]
        if token:
            message = message.replace(token, "***")
        raise Refused(f"{where}: {type(e).__name__}: {message}") from None

    took = time.monotonic() - started
    snapshot = folder / "snapshots" / args.revision
    missing = missing_files(snapshot, listing)
    if missing:
        raise Refused(f"{where}: after the download {len(missing)} files are missing or short "
                      f"({missing[0]} ...)")
    escaped = escaped_files(folder, args.revision, listing)
    if escaped:
        raise Refused(f"{where}: {len(escaped)} files resolve outside the cache "
                      f"{folder}/blobs: {'; '.join(escaped)}")
    fetched = progress.total - have
    print(f"weights: done, {len(listing)} files, {human(progress.total)} in {took:.1f} s "
          f"({human(fetched / took if took > 0 else 0)}/s over {human(fetched)} fetched now)",
          flush=True)
    manifest = manifest_path(args.manifest_dir, args.repo, args.revision)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps({"repo": args.repo, "revision": args.revision,
                               "files": listing}, indent=1, sort_keys=True))
    os.replace(tmp, manifest)


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--manifest-dir", type=Path, required=True)
    parser.add_argument("--endpoint")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token-file", type=Path)
    token.add_argument("--token-stdin", action="store_true",
                       help="read the token from standard input (one line)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--progress-interval", type=float, default=5.0)
    parser.add_argument("--check", action="store_true", help="only say whether it is complete")
    args = parser.parse_args(argv)
    if not REPO_ID.fullmatch(args.repo):
        parser.error(f"--repo {args.repo!r} is not ORG/NAME")
    if not COMMIT.fullmatch(args.revision):
        parser.error(f"--revision {args.revision!r} is not a 40-hex commit hash")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    complete, detail = check(args)
    if args.check:
        print(f"weights: {args.repo}@{args.revision}: "
              f"{'complete' if complete else 'incomplete'} ({detail})")
        return 0 if complete else 1
    if complete:
        print(f"weights: {args.repo}@{args.revision} already complete ({detail})")
        return 0
    args.manifest_dir.mkdir(parents=True, exist_ok=True)
    lock = open(args.manifest_dir / ".lock", "w")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("weights: another fetch holds the lock; waiting", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        complete, detail = check(args)
        if complete:
            print(f"weights: {args.repo}@{args.revision} complete ({detail})")
            return 0
    try:
        remove_orphans(repo_folder(args.cache_dir, args.repo))
        fetch(args)
    except Refused as e:
        print(f"weights: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
