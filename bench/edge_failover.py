"""Benchmark (not a test): how the edge rides over a donor going away and coming back, with the
deploy's own rendered Caddyfiles and real Caddy processes on this machine's loopback.

Two "donors" (each: the GPU-side Caddyfile rendered for a testbed donor, client certificates
required, proxying to a vllm-standin on its loopback port) behind one edge (the edge Caddyfile
rendered for tb-edge, its pool rewritten to the two loopback donors). No network namespaces, so
it runs beside the testbed. A bounded request loop (GET /v1/models through the edge, --count
requests at most, --seconds at most) runs across, for each case:
  model: donor B's model process stopped, then started again (B's Caddy answers 502 meanwhile);
  box:   donor B's Caddy killed, then started again (connections to B refused meanwhile).
Printed per case: requests, answered by A / by B, failed (with their times after the stop), how
long until B got no more requests, how long after the start until B got one again.
A third case, rollout: the rolling rollout's own drain and wait
(donorkit.commands.rollout.RolloutHosts' take_out, wait_in_service, wait_back; its SSH commands run
here instead, the edge's log read from its output file instead of its journal) around a model
restart of A, then of B, under the same loop: requests, failed, and how long each box took to leave
and to rejoin the pool.

    python -m bench.edge_failover [--edge-caddy /usr/bin/caddy] [--donor-caddy /usr/bin/caddy]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from donorkit.commands.transport import https_get
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.host_data import Upstream
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render import templates as render

HOSTNAME = "hermes.ai.unturf.com"
STANDIN = REPO_ROOT / "tests/testbed/standins/vllm-standin"
EDGE_PORT, DONOR_PORTS, MODEL_PORTS = 8443, (9443, 9444), (18888, 18889)


def write(files: list, root: Path, tmp: Path) -> Path:
    """Lay the rendered files out: paths under tmp as they are, others under root."""
    caddyfile = root / "Caddyfile"
    for item in files:
        if item.path.startswith(str(tmp)):
            Path(item.path).parent.mkdir(parents=True, exist_ok=True)
            Path(item.path).write_text(item.content)
        elif item.path == render.CADDYFILE:
            caddyfile.write_text(item.content)
    return caddyfile


class Bench:
    def __init__(self, tmp: Path, edge_caddy: str, donor_caddy: str) -> None:
        self.tmp, self.edge_caddy, self.donor_caddy = tmp, edge_caddy, donor_caddy
        donors, edges = load_inventory(REPO_ROOT / "tests/testbed/donors.yml")
        pki = str(tmp / "pki")
        self.donor_files = []
        for i, name in enumerate(("tb-4090", "tb-4090b")):
            data = donors[name].model_copy(update=dict(
                pki_dir=pki, caddy_tls_dir=str(tmp / name / "tls"), install_root=str(tmp / name),
                caddy_access_log=str(tmp / name / "access.log"), caddy_https_port=DONOR_PORTS[i],
                caddy_admin_socket=str(tmp / name / "admin.sock"),
                models={"qwen": donors[name].models["qwen"].model_copy(
                    update={"port": MODEL_PORTS[i]})}))
            self.donor_files.append(write(render.render_host(data), tmp / name, tmp))
        pool = [Upstream.model_construct(donor=n, address=f"127.0.0.1:{p}")  # labels, not names
                for n, p in zip(("A", "B"), DONOR_PORTS, strict=True)]
        edge = edges["tb-edge"].model_copy(update=dict(
            pki_dir=pki, caddy_tls_dir=str(tmp / "edge" / "tls"),
            caddy_access_log=str(tmp / "edge" / "access.log"), edge_https_port=EDGE_PORT,
            caddy_admin_socket=str(tmp / "edge" / "admin.sock"),
            sites=[site.model_copy(update={"upstreams": pool}) for site in edges["tb-edge"].sites]))
        self.edge_file = write(render.render_edge(edge), tmp / "edge", tmp)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ca = tmp / "pki" / "ca.crt"

    def start(self, key: str, argv: list[str]) -> None:
        log = open(self.tmp / f"{key}.log", "a")  # noqa: SIM115 - kept open for the process
        self.procs[key] = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)

    def stop(self, key: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(key)
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def model(self, i: int) -> list[str]:
        return [sys.executable, str(STANDIN), "serve", "turboderp/Qwen3.8-27B-exl3",
                "--host", "127.0.0.1", "--port", str(MODEL_PORTS[i])]

    def caddy(self, binary: str, caddyfile: Path) -> list[str]:
        return [binary, "run", "--adapter", "caddyfile", "--config", str(caddyfile)]

    def up(self) -> None:
        for i, key in enumerate("AB"):
            self.start(f"model{key}", self.model(i))
            self.start(f"caddy{key}", self.caddy(self.donor_caddy, self.donor_files[i]))
        self.start("edge", self.caddy(self.edge_caddy, self.edge_file))
        time.sleep(5)  # Caddies up, the edge's first health checks done

    def down(self) -> None:
        for key in list(self.procs):
            self.stop(key)

    def get(self, seq: str) -> int | str:
        try:
            return https_get("127.0.0.1", EDGE_PORT, HOSTNAME, "/v1/models", self.ca, timeout=30,
                             headers={"X-Loop": seq})[0]
        except (OSError, http.client.HTTPException) as exc:
            return type(exc).__name__

    def served_by(self, key: str, tag: str) -> set[int]:
        """Loop requests a donor's Caddy logged (its access log or its own output)."""
        seqs = set()
        for path in (self.tmp / f"caddy{key}.log", self.tmp / ("tb-4090" if key == "A"
                                                               else "tb-4090b") / "access.log"):
            if path.exists():
                for line in path.read_text().splitlines():
                    if tag in line and line.startswith("{"):
                        value = (json.loads(line).get("request", {}).get("headers", {})
                                 .get("X-Loop", [""])[0])
                        if value.startswith(f"{tag}-"):
                            seqs.add(int(value.rsplit("-", 1)[1]))
        return seqs

    def case(self, name: str, go_down, come_back, count: int, seconds: float) -> None:
        tag = f"{name}{os.getpid()}"
        results: list[tuple[int, float, int | str]] = []
        done = threading.Event()

        def loop() -> None:
            started = time.monotonic()
            for seq in range(count):
                if done.is_set() or time.monotonic() - started > seconds:
                    break
                sent = time.time()
                results.append((seq, sent, self.get(f"{tag}-{seq}")))
                time.sleep(0.05)

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(3)
        t_down = time.time()
        go_down()
        time.sleep(10)
        t_up = time.time()
        come_back()
        time.sleep(10)
        done.set()
        thread.join()
        on_a, on_b = self.served_by("A", tag), self.served_by("B", tag)
        sent = {seq: at for seq, at, _ in results}
        failed = [(round(at - t_down, 2), status) for _, at, status in results if status != 200]
        last_b = max((sent[s] for s in on_b if t_down - 1 < sent[s] < t_up), default=None)
        back_b = min((sent[s] for s in on_b if sent[s] > t_up), default=None)
        print(f"{name}: {len(results)} requests, {len(on_a)} answered by A, {len(on_b)} by B, "
              f"{len(failed)} failed {failed}; B down for {t_up - t_down:.1f} s: "
              + (f"its last request {last_b - t_down:.2f} s after it went down, "
                 if last_b else "no request reached it after it went down, ")
              + (f"first request again {back_b - t_up:.2f} s after it came back"
                 if back_b else "no request reached it after it came back"), flush=True)


class LocalRemote:
    """donorkit.commands.transport.SshRunner's commands, run here (the bench's hosts are local)."""

    def run(self, command: str) -> tuple[int, str]:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        return done.returncode, done.stdout if done.returncode == 0 else (
            done.stdout + done.stderr).strip()

    def close(self) -> None:
        pass


def rollout_case(bench: Bench, count: int, seconds: float) -> None:
    from donorkit.commands import rollout, rollout_plan

    tmp = bench.tmp
    donors, edges = load_inventory(REPO_ROOT / "tests/testbed/donors.yml")
    boxes = []
    for i, name in enumerate(("tb-4090", "tb-4090b")):
        data = donors[name].model_copy(update=dict(
            pki_dir=str(tmp / "pki"), install_root=str(tmp / name), ssh_hostname="127.0.0.1",
            caddy_https_port=DONOR_PORTS[i],
            models={"qwen": donors[name].models["qwen"].model_copy(
                update={"port": MODEL_PORTS[i]})}))
        boxes.append(rollout_plan.Box(name, data))
    pool = [Upstream(donor=b.name, address=f"127.0.0.1:{p}")
            for b, p in zip(boxes, DONOR_PORTS, strict=True)]
    edge = edges["tb-edge"].model_copy(update=dict(
        caddy_admin_socket=str(tmp / "edge" / "admin.sock"),
        sites=[site.model_copy(update={"upstreams": pool}) for site in edges["tb-edge"].sites]))

    class LocalFleet(rollout.RolloutHosts):
        def remote(self, host):
            return LocalRemote()

        def edge_events(self, edge, address, since):
            return rollout_plan.health_events((tmp / "edge.log").read_text(), address)

    fleet = LocalFleet(boxes, [rollout_plan.Edge("tb-edge", edge)])
    tag = f"rollout{os.getpid()}"
    results: list[int | str] = []
    done = threading.Event()

    def loop() -> None:
        started = time.monotonic()
        for seq in range(count):
            if done.is_set() or time.monotonic() - started > seconds:
                break
            results.append(bench.get(f"{tag}-{seq}"))
            time.sleep(0.05)

    thread = threading.Thread(target=loop)
    thread.start()
    timings = []
    try:
        for i, box in enumerate(boxes):
            began = time.monotonic()
            since, why = fleet.take_out(box, 60)
            assert why is None, why
            out = time.monotonic() - began
            key = "AB"[i]
            bench.stop(f"model{key}")
            bench.start(f"model{key}", bench.model(i))
            Path(render.drain_flag(box.data)).unlink()  # the deploy's last step
            began = time.monotonic()
            why = fleet.wait_in_service(box, 60) or fleet.wait_back(box, since, 60)
            assert why is None, why
            timings.append(f"{box.name} out of the pool in {out:.1f} s, back "
                           f"{time.monotonic() - began:.1f} s after its flag went")
    finally:
        done.set()
        thread.join()
    failed = [status for status in results if status != 200]
    print(f"rollout: {len(results)} requests, {len(bench.served_by('A', tag))} answered by A, "
          f"{len(bench.served_by('B', tag))} by B, {len(failed)} failed {failed[:5]}; "
          + "; ".join(timings), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge-caddy", default=shutil.which("caddy") or "/usr/bin/caddy")
    parser.add_argument("--donor-caddy", default=shutil.which("caddy") or "/usr/bin/caddy")
    parser.add_argument("--count", type=int, default=1000, help="requests at most per case")
    parser.add_argument("--seconds", type=float, default=60, help="seconds at most per case")
    args = parser.parse_args()
    # Stopped (a CI timeout, an operator's kill): leave no stand-in or Caddy on its ports.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for binary in (args.edge_caddy, args.donor_caddy):
        version = subprocess.run([binary, "version"], capture_output=True, text=True).stdout
        print(f"{binary}: {version.split()[0] if version else '?'}")
    with tempfile.TemporaryDirectory(prefix="edge-failover-") as name:
        bench = Bench(Path(name), args.edge_caddy, args.donor_caddy)
        try:
            bench.up()
            bench.case("model", lambda: bench.stop("modelB"),
                       lambda: bench.start("modelB", bench.model(1)), args.count, args.seconds)
            bench.case("box", lambda: bench.stop("caddyB", signal.SIGKILL),
                       lambda: bench.start("caddyB", bench.caddy(args.donor_caddy,
                                                                  bench.donor_files[1])),
                       args.count, args.seconds)
            rollout_case(bench, args.count, args.seconds * 3)
        finally:
            bench.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
