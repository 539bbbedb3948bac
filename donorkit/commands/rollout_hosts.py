"""The fleet as the rolling rollout reaches it (donorkit/commands/rollout.py drives it): SSH to
each box and edge opened when first needed (an unreachable one is one line), the rollout's locks,
whether a box serves again (through its GPU-side Caddy as an edge asks, or on its loopback), and
taking a box out of the edges' pools (its drain flag) and waiting for it to be back. The decisions
behind each (batches, the edges' view, the lock's commands) are
donorkit/commands/rollout_plan.py."""

from __future__ import annotations

import http.client
import json
import shlex
import time
from pathlib import Path

from donorkit.commands.rollout_plan import (
    Box,
    Edge,
    RolloutLocked,
    edge_sees,
    health_events,
    lock_command,
    lock_path,
    unlock_command,
    upstream_requests,
)
from donorkit.commands.transport import (
    SshRunner,
    ca_file,
    edge_client_pair,
    https_get,
    shown,
    wait_until,
)
from donorkit.render.templates import drain_flag


def gpu_side_check(box: Box, hostname: str, checkpoint: str,
                   client: tuple[Path | str, Path | str], timeout: float = 5) -> str | None:
    """None when the box's Caddy lists `checkpoint` on /v1/models for `hostname`, asked as an
    edge asks it (its client certificate `client`); else why."""
    try:
        status, body = https_get(box.data.ssh_hostname, box.data.caddy_https_port,
                                 hostname, "/v1/models", ca_file(box.data), client, timeout,
                                 proxy=box.data.caddy_proxy_command)
        if status != 200:
            return f"{hostname}: HTTP {status}"
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
        return None if checkpoint in ids else shown(
            f"{hostname}: {checkpoint} not listed ({', '.join(map(str, ids)) or 'none'})")
    except (OSError, ValueError, http.client.HTTPException) as e:
        return shown(f"{hostname}: {type(e).__name__}: {e}")


class Unreachable(Exception):
    """SSH to a box or an edge failed; the message names which, where, and the cause."""

    def __init__(self, host: Box | Edge, exc: BaseException) -> None:
        data = host.data
        kind = "edge" if data.role == "edge" else "box"
        super().__init__(f"{kind} {host.name} ({data.ssh_user}@{data.ssh_hostname}:"
                         f"{data.ssh_port}) unreachable: "
                         + f"{type(exc).__name__}: {exc}".splitlines()[0])


class RolloutHosts:
    """The boxes, the edges, and SSH connections to them opened when first needed."""

    def __init__(self, boxes: list[Box], edges: list[Edge]) -> None:
        self.boxes, self.edges = boxes, edges
        self._remotes: dict[str, SshRunner] = {}

    def remote(self, host: Box | Edge) -> SshRunner:
        if host.name not in self._remotes:
            try:
                self._remotes[host.name] = SshRunner(host.data)
            except Exception as exc:  # noqa: BLE001 - every way of not reaching it: one line
                raise Unreachable(host, exc) from None
        return self._remotes[host.name]

    def close(self) -> None:
        for remote in self._remotes.values():
            remote.close()

    def lock(self, boxes: list[Box], holder: str) -> None:
        """Take every box's rollout lock, in the given (inventory) order: two drivers whose
        plans share boxes meet at the first shared one, and only one gets past it. Refused: the
        locks taken so far are removed and RolloutLocked says who holds the box's."""
        self.locked: list[Box] = []
        for box in boxes:
            rc, out = self.remote(box).run(lock_command(lock_path(box), holder))
            if rc != 0:
                self.unlock(holder)
                held = shown(out.strip() if rc == 3 else f"cannot take the lock: {out.strip()}")
                raise RolloutLocked(f"{box.name}: another rollout holds {lock_path(box)}: {held}"
                                    if rc == 3 else f"{box.name}: {held}")
            self.locked.append(box)

    def unlock(self, holder: str) -> None:
        """Remove the locks this driver took (each only if it still holds it)."""
        for box in reversed(getattr(self, "locked", [])):
            self.remote(box).run(unlock_command(lock_path(box), holder))
        self.locked = []

    def edges_of(self, box: Box) -> list[tuple[Edge, str]]:
        """(edge, upstream address) for every edge pool the box is in."""
        return [(edge, address) for edge in self.edges for address in edge.pool_of(box)]

    def edge_clock(self, edge: Edge) -> float:
        rc, out = self.remote(edge).run("date +%s.%N")
        if rc != 0:
            raise RuntimeError(f"{edge.name}: date: {shown(out)}")
        return float(out)

    def edge_events(self, edge: Edge, address: str, since: float) -> list[tuple[float, bool]]:
        rc, out = self.remote(edge).run(
            f"journalctl -u caddy -o cat --no-pager --since=@{int(since) - 1}")
        if rc != 0:
            raise RuntimeError(f"{edge.name}: journalctl: {shown(out)}")
        return health_events(out, address)

    def in_flight(self, edge: Edge, address: str) -> int | None:
        socket_path = shlex.quote(edge.data.caddy_admin_socket)
        rc, out = self.remote(edge).run(
            f"curl -sS --unix-socket {socket_path} -H 'Host: ' "
            "http://localhost/reverse_proxy/upstreams")
        if rc != 0:
            raise RuntimeError(f"{edge.name}: admin API: {shown(out)}")
        return upstream_requests(out, address)

    def in_service(self, box: Box) -> str | None:
        """None when every hostname of the box is served through its Caddy, asked as an edge
        of that hostname asks (with its client certificate), and no edge's health checker is
        failing it now; else the first reason not. A hostname no edge serves is checked on the
        box's loopback (over SSH): without an edge's certificate its Caddy answers nobody."""
        for hostname, checkpoint in box.routes.items():
            edges = [e for e in self.edges
                     if any(s.hostname == hostname for s in e.data.sites)]
            if edges:
                why = gpu_side_check(box, hostname, checkpoint,
                                     edge_client_pair(box.data, edges[0].name))
            else:
                why = self.loopback_check(box, hostname, checkpoint)
            if why:
                return why
        for edge, address in self.edges_of(box):
            now = self.edge_clock(edge)
            if edge_sees(self.edge_events(edge, address, now - edge.health_wait), now
                         - edge.health_wait, now, 0) == "down":
                return f"{edge.name}'s health check fails {address}"
        return None

    def loopback_check(self, box: Box, hostname: str, checkpoint: str) -> str | None:
        model = next(m for m in box.data.models.values() if m.checkpoint == checkpoint)
        rc, out = self.remote(box).run(
            f"curl -sS -m 5 http://127.0.0.1:{model.port}/v1/models")
        if rc != 0:
            return f"{hostname}: loopback: {shown(out)}"
        try:
            ids = [m.get("id") for m in json.loads(out).get("data", [])]
        except (ValueError, AttributeError):
            return f"{hostname}: loopback: not JSON: {shown(out)}"
        return None if checkpoint in ids else shown(
            f"{hostname}: {checkpoint} not listed ({', '.join(map(str, ids)) or 'none'})")

    def wait_in_service(self, box: Box, timeout: float) -> str | None:
        return wait_until(lambda: self.in_service(box), timeout, interval=1)

    def take_out(self, box: Box, timeout: float) -> tuple[dict[str, float], str | None]:
        """Out of every edge pool it is in, with nothing in flight to it: ({edge: its clock
        when the flag was made}, None), or why not within `timeout`."""
        pooled = self.edges_of(box)
        if not pooled:
            return {}, None
        since = {edge.name: self.edge_clock(edge) for edge, _ in pooled}
        flag = shlex.quote(drain_flag(box.data))
        rc, out = self.remote(box).run(f"mkdir -p \"$(dirname {flag})\" && touch {flag}")
        if rc != 0:
            return since, f"creating its drain flag: {shown(out)}"
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def logged_down(edge: Edge, address: str) -> str | None:
            seen = edge_sees(self.edge_events(edge, address, since[edge.name]),
                             since[edge.name], 0, 0)
            return None if seen == "down" else (
                f"{edge.name} logged no failed health check for {address}")

        def idle(edge: Edge, address: str) -> str | None:
            return (f"{edge.name} still has requests in flight to {address}"
                    if self.in_flight(edge, address) else None)

        for edge, address in pooled:
            why = wait_until(lambda e=edge, a=address: logged_down(e, a), left(), 0.5)
            if why:
                return since, why
        # Every checker of each edge has had its turn; then no request may be on its way.
        time.sleep(max(edge.health_wait for edge, _ in pooled))
        for edge, address in pooled:
            why = wait_until(lambda e=edge, a=address: idle(e, a), left(), 0.5)
            if why:
                return since, why
        return since, None

    def wait_back(self, box: Box, since: dict[str, float], timeout: float) -> str | None:
        """Each edge's health checker has logged the box up after it was taken out, and no
        failure since for one health interval + timeout."""
        deadline = time.monotonic() + timeout

        def logged_up(edge: Edge, address: str) -> str | None:
            seen = edge_sees(self.edge_events(edge, address, since[edge.name]),
                             since[edge.name], self.edge_clock(edge), edge.health_wait)
            return None if seen == "up" else (
                f"{edge.name}'s health check does not see {address} up ({seen})")

        for edge, address in self.edges_of(box):
            why = wait_until(lambda e=edge, a=address: logged_up(e, a),
                             max(0.0, deadline - time.monotonic()), 1)
            if why:
                return why
        return None
