"""STAND-IN (test double) for the Hugging Face Hub: huggingface.co cannot be reached from here.

The testbed's HTTP server (`python -m tests.support.hub_standin`), which also serves the testbed's
static files (`--directory`, what `python -m http.server` served before). It answers the requests
the REAL huggingface_hub client (pyproject.toml pins the version read) makes for
`snapshot_download` when pointed at it with `HF_ENDPOINT` / `endpoint=`:

- `GET /api/models/<repo>[/revision/<rev>]`   model info (sha = the commit, siblings)
- `GET /api/models/<repo>/tree/<rev>[/<path>]?recursive=`   the file listing (oid, size, lfs)
- `HEAD|GET /<repo>/resolve/<rev>/<file>`   small files: 200 with ETag (git blob id), X-Repo-Commit,
  Content-Length; large ("LFS") files: 302 to the CDN port with X-Linked-Etag (sha256),
  X-Linked-Size and X-Repo-Commit, as the hub redirects to its CDN (another origin: the client
  drops its Authorization header there, as it does for the real CDN)
- `GET /_cdn/<sha256>` on the CDN port: the blob, with `Range: bytes=N-` answered 206.

Repositories are folders `<hub-root>/<org>/<name>/` (every file in them is the repo); each has one
commit, a hash of its file list and blob ids, so the same files always give the same revision.
`main` resolves to it; any other revision is RevisionNotFound.

Test controls (JSON, same port): `POST /_standin/fault` {"file": path-in-repo, "cut_after": bytes,
"times": 1, "throttle_bps": bytes/s} -- the next GET(s) of that file send the full headers, then
close the connection after `cut_after` bytes (an interrupted download), and/or trickle at
`throttle_bps`; `POST /_standin/gate` {"repo": id, "token": str} -- the repo then needs
`Authorization: Bearer <token>` (a gated model); `POST /_standin/etag` {"file": path-in-repo,
"etag": str} -- a HOSTILE hub: that file's resolve answers carry this ETag (X-Linked-Etag for a
large file) instead of its hash, e.g. `../../../x` (huggingface_hub builds the blob's path from it);
`GET /_standin/requests` -- every request served (method, path, range, status, body bytes);
`POST /_standin/reset` -- log, faults, gates and ETags cleared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# Files at least this big, or with a weights suffix, are served as the hub serves LFS/Xet files
# (redirect to the CDN, X-Linked-* headers); the rest as plain git blobs.
LFS_MIN_SIZE = 1 << 20
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".pth")
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
ROUTES = [
    ("info", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("tree", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$")),
    ("resolve", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("cdn", re.compile(r"^/_cdn/(?P<sha>[0-9a-f]{64})$")),
]
CHUNK = 64 * 1024


@dataclass(frozen=True)
class RepoFile:
    path: str           # path in the repo, '/'-separated
    source: Path        # where its bytes are on this machine
    size: int
    blob_id: str        # git blob sha1 (the hub's oid and a small file's ETag)
    sha256: str | None  # LFS files only (their ETag)


@dataclass
class Repo:
    repo_id: str
    commit: str
    files: dict[str, RepoFile]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_repo(repo_id: str, folder: Path) -> Repo:
    files: dict[str, RepoFile] = {}
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = src.relative_to(folder).as_posix()
        data = src.read_bytes()
        lfs = len(data) >= LFS_MIN_SIZE or rel.endswith(LFS_SUFFIXES)
        sha = hashlib.sha256(data).hexdigest() if lfs else None
        # An LFS file's git blob is its pointer file, as in a real repository.
        blob = git_blob_id(_lfs_pointer(sha, len(data)) if sha else data)
        files[rel] = RepoFile(rel, src, len(data), blob, sha)
    listing = "".join(f"{f.path}\0{f.blob_id}\n" for f in files.values())
    commit = hashlib.sha1(f"hub-standin\n{listing}".encode()).hexdigest()
    return Repo(repo_id, commit, files)


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


def load_repos(hub_root: Path) -> dict[str, Repo]:
    repos = {}
    for folder in sorted(hub_root.glob("*/*")):
        if folder.is_dir():
            repo_id = f"{folder.parent.name}/{folder.name}"
            repos[repo_id] = load_repo(repo_id, folder)
    return repos


# --- the generated checkpoint ------------------------------------------------------------------

def generate_checkpoint(dest: Path, shard_bytes: int = 24 << 20, shards: int = 2) -> None:
    """A small, always identical checkpoint in a real checkpoint's shape: config, tokenizer
    config, safetensors shards and their index. Deterministic bytes (SHAKE-256 of a fixed seed),
    so its revision is the same on every machine and every run. Shards are bigger than the
    client's 10 MiB read size: an interrupted download can then resume past its start."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = {
        "config.json": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                        "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1024,
                        "note": "hub stand-in: generated bytes, not a model"},
        "generation_config.json": {"do_sample": False},
        "tokenizer_config.json": {"model_max_length": 65536},
    }
    for name, body in files.items():
        (dest / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensor = f"layers.{i - 1}.weight"
        payload = hashlib.shake_256(f"hub-standin shard {i}".encode()).digest(shard_bytes)
        header = json.dumps({tensor: {"dtype": "U8", "shape": [shard_bytes],
                                      "data_offsets": [0, shard_bytes]}}).encode()
        header += b" " * (-len(header) % 8)
        (dest / name).write_bytes(len(header).to_bytes(8, "little") + header + payload)
        weight_map[tensor] = name
    index = {"metadata": {"total_size": shards * shard_bytes}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (dest / "README.md").write_text("Hub stand-in checkpoint (testbed). Not a model.\n")


# --- the server ---------------------------------------------------------------------------------

@dataclass
class Fault:
    cut_after: int | None = None
    times: int = 1
    throttle_bps: int | None = None


@dataclass
class HubState:
    repos: dict[str, Repo]
    cdn_port: int | None
    faults: dict[str, Fault] = field(default_factory=dict)
    gates: dict[str, str] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)   # path in repo -> hostile ETag
    requests: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def blob(self, sha: str) -> RepoFile | None:
        for repo in self.repos.values():
            for f in repo.files.values():
                if f.sha256 == sha:
                    return f
        return None

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            fault = self.faults.get(path)
            if fault is None:
                return None
            fault.times -= 1
            if fault.times <= 0:
                del self.faults[path]
            return fault


class Handler(SimpleHTTPRequestHandler):
    """The hub's endpoints first; anything else is a static file under --directory."""

    state: HubState
    cdn_only = False

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    # One entry per request, for tests that count what a download asked for.
    def _record(self, status: int, sent: int) -> None:
        with self.state.lock:
            self.state.requests.append({"method": self.command, "path": self.path,
                                        "range": self.headers.get("Range"), "status": status,
                                        "bytes": sent, "time": time.time()})

    def do_HEAD(self):
        if not self._hub():
            super().do_HEAD()

    def do_GET(self):
        if not self._hub():
            super().do_GET()

    def do_POST(self):
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return self._json(400, {"error": "body is not JSON"}, record=False)
        with self.state.lock:
            if url.path == "/_standin/fault":
                self.state.faults[body["file"]] = Fault(body.get("cut_after"),
                                                        int(body.get("times", 1)),
                                                        body.get("throttle_bps"))
            elif url.path == "/_standin/gate":
                self.state.gates[body["repo"]] = body["token"]
            elif url.path == "/_standin/etag":
                self.state.etags[body["file"]] = body["etag"]
            elif url.path == "/_standin/reset":
                self.state.faults.clear()
                self.state.gates.clear()
                self.state.etags.clear()
                self.state.requests.clear()
            else:
                return self._json(404, {"error": "no such control"}, record=False)
        # Controls are not requests a client made: the log stays the client's.
        return self._json(200, {"ok": True}, record=False)

    # --- hub routing ---

    def _hub(self) -> bool:
        url = urlsplit(self.path)
        path = url.path
        if path == "/_standin/requests" and not self.cdn_only:
            with self.state.lock:
                log = list(self.state.requests)
            self._json(200, log, record=False)
            return True
        for name, pattern in ROUTES:
            match = pattern.match(path)
            if match and (name == "cdn") == self.cdn_only:
                groups = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
                getattr(self, f"_{name}")(parse_qs(url.query), **groups)
                return True
        if self.cdn_only:
            self._json(404, {"error": "not found"})
            return True
        return False

    def _repo_at(self, repo_id: str, rev: str | None) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._json(404, {"error": "Repository not found"}, code="RepoNotFound")
            return None
        token = self.state.gates.get(repo_id)
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            self._json(401, {"error": f"Access to model {repo_id} is restricted."},
                       code="GatedRepo")
            return None
        if rev not in (None, "main", repo.commit):
            self._json(404, {"error": f"Invalid rev id: {rev}"}, code="RevisionNotFound")
            return None
        return repo

    def _info(self, query, repo: str, rev: str | None = None):
        found = self._repo_at(repo, rev)
        if found is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in found.files.values():
            entry: dict = {"rfilename": f.path}
            if blobs:
                entry.update(size=f.size, blobId=f.blob_id)
                if f.sha256:
                    entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(entry)
        author = repo.split("/")[0]
        self._json(200, {"_id": found.commit[:24], "id": repo, "modelId": repo, "author": author,
                         "sha": found.commit, "lastModified": "2026-01-01T00:00:00.000Z",
                         "createdAt": "2026-01-01T00:00:00.000Z", "private": False,
                         "gated": repo in self.state.gates and "manual" or False,
                         "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                         "library_name": "transformers", "siblings": siblings})

    def _tree(self, query, repo: str, rev: str, path: str | None = None):
        found = self._repo_at(repo, rev)
        if found is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{path.strip('/')}/" if path else ""
        entries, folders = [], set()
        for f in found.files.values():
            if not f.path.startswith(prefix):
                continue
            rest = f.path[len(prefix):]
            if not recursive and "/" in rest:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            entry: dict = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        if recursive:
            for f in found.files.values():
                parts = f.path[len(prefix):].split("/")[:-1] if f.path.startswith(prefix) else []
                for i in range(1, len(parts) + 1):
                    folders.add(prefix + "/".join(parts[:i]))
        entries += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                     "path": d} for d in sorted(folders)]
        self._json(200, entries)

    def _resolve(self, query, repo: str, rev: str, path: str):
        found = self._repo_at(repo, rev)
        if found is None:
            return
        f = found.files.get(path)
        headers = {"X-Repo-Commit": found.commit}
        if f is None:
            return self._json(404, {"error": "Entry not found"}, code="EntryNotFound",
                              headers=headers)
        hostile = self.state.etags.get(path)
        if f.sha256 and self.state.cdn_port:
            host = (self.headers.get("Host") or self.server.server_address[0]).rsplit(":", 1)[0]
            self._record(302, 0)
            self.send_response(302)
            for key, value in {**headers, "ETag": f'"{f.blob_id}"',
                               "X-Linked-Etag": f'"{hostile or f.sha256}"',
                               "X-Linked-Size": str(f.size),
                               "Location": f"http://{host}:{self.state.cdn_port}/_cdn/{f.sha256}",
                               "Content-Length": "0"}.items():
                self.send_header(key, value)
            self.end_headers()
            return
        etag = hostile or f.sha256 or f.blob_id
        self._file(f, {**headers, "ETag": f'"{etag}"'})

    def _cdn(self, query, sha: str):
        f = self.state.blob(sha)
        if f is None:
            return self._json(404, {"error": "no such blob"})
        self._file(f, {"ETag": f'"{sha}"'})

    # --- responses ---

    def _file(self, f: RepoFile, headers: dict[str, str]):
        start = 0
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
            if not match or int(match.group(1)) >= max(f.size, 1):
                self._record(416, 0)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{f.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(match.group(1))
            status = 206
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        self.send_response(status)
        for key, value in {**headers, "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream",
                           "Content-Length": str(f.size - start)}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "HEAD":
            self._record(status, 0)
            return
        fault = self.state.take_fault(f.path)
        limit = f.size - start
        if fault and fault.cut_after is not None:
            limit = min(limit, fault.cut_after)
        sent = 0
        began = time.monotonic()
        try:
            with f.source.open("rb") as src:
                src.seek(start)
                while sent < limit:
                    chunk = src.read(min(CHUNK, limit - sent))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    if fault and fault.throttle_bps:
                        ahead = sent / fault.throttle_bps - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self._record(status, sent)
        if sent < f.size - start:
            # The interrupted download: headers promised more; the connection ends here.
            self.close_connection = True
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _json(self, status: int, body, code: str | None = None,
              headers: dict[str, str] | None = None, record: bool = True):
        data = json.dumps(body).encode()
        if record:
            self._record(status, len(data) if self.command != "HEAD" else 0)
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if code:
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", str(body.get("error", "")))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class Server(ThreadingHTTPServer):
    daemon_threads = True


def make_servers(bind: str, port: int, cdn_port: int, directory: Path,
                 hub_root: Path) -> tuple[Server, Server, HubState]:
    """The hub/static server and the CDN server (port 0: any free port). Not started."""
    state = HubState(load_repos(hub_root), None)
    hub_cls = type("HubHandler", (Handler,), {"state": state})
    cdn_cls = type("CdnHandler", (Handler,), {"state": state, "cdn_only": True})
    hub = Server((bind, port), partial(hub_cls, directory=str(directory)))
    cdn = Server((bind, cdn_port), partial(cdn_cls, directory=str(directory)))
    state.cdn_port = cdn.server_address[1]
    return hub, cdn, state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cdn-port", type=int, required=True)
    parser.add_argument("--directory", type=Path, required=True, help="static files")
    parser.add_argument("--hub-root", type=Path, required=True, help="<org>/<name>/ folders")
    args = parser.parse_args(argv)
    hub, cdn, state = make_servers(args.bind, args.port, args.cdn_port, args.directory,
                                   args.hub_root)
    for repo in state.repos.values():
        print(f"hub stand-in: {repo.repo_id} @ {repo.commit} ({len(repo.files)} files)",
              file=sys.stderr, flush=True)
    threading.Thread(target=cdn.serve_forever, daemon=True).start()
    hub.serve_forever()


if __name__ == "__main__":
    main()
