"""Watching a rollout from outside (the testbed's rollout case and bench/rollout.py):

- `RequestLoop`: a bounded loop of GET /v1/models, either through an edge as a public client
  (`edge=ADDRESS`: the public hostname as SNI and Host, no client certificate; what users see),
  or through each box's GPU-side Caddy as an edge asks (`client=(cert, key)` from the client CA),
  counting per box (or for the edge) what was sent and what failed, and the rounds in which every
  box failed.
- `outages`: each box's out-of-service windows from its own journal: systemd's "Stopping" line
  for the vLLM unit to the stand-in's "loaded after" line (the unit stop to /v1/models ready).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from donorkit.commands.rollout_hosts import gpu_side_check
from donorkit.commands.rollout_plan import Box
from donorkit.commands.transport import https_get

from .hosts import Host, ssh


@dataclass
class RequestLoop:
    boxes: list[Box]
    hostname: str
    checkpoint: str
    client: tuple[str, str] | None = None
    edge: str | None = None
    cafile: str | None = None
    tag: str = ""  # through the edge: an X-Loop header TAG-N on request N (the donors log it)
    interval: float = 0.25
    max_seconds: float = 900
    sent: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    all_failed_rounds: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lane = threading.Lock()  # a round holds it: `held` waits for the one in flight

    @contextmanager
    def held(self) -> Iterator[None]:
        """No request of the loop's while the `with` lasts (a round in flight finishes first):
        a test's own requests through the edge meanwhile meet no loop request there."""
        with self._lane:
            yield

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds  # bounded in time, so in count too
        while not self._stop.is_set() and time.monotonic() < deadline:
            ok = []
            if self.edge:
                targets = [("edge", lambda: self._via_edge())]
            else:
                targets = [(box.name, lambda box=box: gpu_side_check(
                    box, self.hostname, self.checkpoint, self.client, timeout=3))
                    for box in self.boxes]
            with self._lane:
                for name, check in targets:
                    why = check()
                    self.sent[name] = self.sent.get(name, 0) + 1
                    if why:
                        self.failed[name] = self.failed.get(name, 0) + 1
                        if len(self.errors) < 20:
                            self.errors.append(f"{name} at {time.time():.2f}: {why}")
                    ok.append(why is None)
                self.rounds += 1
            self.all_failed_rounds += not any(ok)
            self._stop.wait(self.interval)

    def _via_edge(self) -> str | None:
        """A public client's GET through the edge (one connection per request, as the request
        loops of the edge cases); only ever a GET, never re-sent."""
        try:
            headers = {"X-Loop": f"{self.tag}-{self.rounds}"} if self.tag else {}
            status, body = https_get(self.edge, 443, self.hostname, "/v1/models", self.cafile,
                                     timeout=30, headers=headers)
            if status != 200:
                return f"HTTP {status}"
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
            return None if self.checkpoint in ids else f"{self.checkpoint} not listed ({ids})"
        except (OSError, ValueError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {e}"

    def summary(self) -> str:
        per_box = ", ".join(f"{n} {self.failed.get(n, 0)}/{self.sent[n]} failed"
                            for n in sorted(self.sent))
        return (f"{self.rounds} rounds ({sum(self.sent.values())} requests): {per_box}; "
                f"rounds with no box answering: {self.all_failed_rounds}")


def outages(host: Host, unit: str, since: float) -> list[tuple[float, float | None]]:
    """(stopped, ready) wall-clock pairs for `unit` since `since` (epoch seconds), from the
    host's journal; ready is None if the unit never came back."""
    out = ssh(host, f"journalctl -u {unit} -o json --no-pager --since @{int(since)}").stdout
    windows: list[tuple[float, float | None]] = []
    for line in out.splitlines():
        entry = json.loads(line)
        message = entry.get("MESSAGE")
        if isinstance(message, list):  # journald gives bytes as a list of ints
            message = bytes(message).decode(errors="replace")
        when = int(entry["__REALTIME_TIMESTAMP"]) / 1e6
        if message.startswith("Stopping ") and (not windows or windows[-1][1] is not None):
            windows.append((when, None))
        elif " loaded after " in message and windows and windows[-1][1] is None:
            windows[-1] = (windows[-1][0], when)
    return windows


def overlapping(windows: dict[str, list[tuple[float, float | None]]]) -> list[str]:
    """Pairs of boxes whose out-of-service windows overlap (an open window runs to now)."""
    now = time.time()
    flat = [(name, start, end or now) for name, ws in windows.items() for start, end in ws]
    clashes = []
    for i, (a, s1, e1) in enumerate(flat):
        for b, s2, e2 in flat[i + 1:]:
            if a != b and s1 < e2 and s2 < e1:
                clashes.append(f"{a} [{s1:.1f}, {e1:.1f}] and {b} [{s2:.1f}, {e2:.1f}]")
    return clashes
