"""The real vLLM 0.26.0 engine, started from the units `make render` writes, on the lent GPU
machine (the `device` tool's H200: torch 2.11.0+cu130, no vLLM, no network, no systemd).

    python3 -m gpu.engine_run receive     # each carry call: keep .gpu-engine/carry/NN/part
    python3 -m gpu.engine_run launch      # unpack, then run everything in the background
    python3 -m gpu.engine_run follow      # print progress until done (or --max seconds)

Built on the operator's machine by gpu/engine_carry.py; the README's "The real engine on a GPU"
gives the calls. What runs, in order (the background daemon; results under /root/engine/results,
copied to $OUT by `follow`):
Steps 1-3 and the shipped-kernels box are gpu/engine_box.py.
1. install: a venv at the units' venv_dir that sees the image's site-packages (torch 2.11.0+cu130),
   with only the carried wheels the image lacks or holds at a version outside vLLM's set
   (requirements.json), installed --no-deps --no-index; ninja and vllm always into the venv (the
   units' PATH starts with its bin/, and FlashInfer's JIT runs a bare `ninja`).
2. toolkit: /usr/local/cuda-13.3 from NVIDIA's PyPI wheels (the testbed's layout code).
3. the service user the units name, its Hugging Face cache holding the stand-in checkpoints under
   the real checkpoint ids (as the deploy's weights step leaves them; HF_HUB_OFFLINE=1 as the unit
   says), so ExecStart names the checkpoint exactly as rendered.
4. each engine: ExecStart, User= and every Environment= line read from the rendered unit; the one
   change is dropping `--quantization exl3` from the qwen unit (the operator's vllm-exl3 plugin is
   not in this repository; the stand-in has plain weights). Not applied: the unit's sandbox and
   MemoryMax (no systemd here); the peak host memory is recorded against MemoryMax instead.
   Runs by default (the sixth run, 2026-12-03 evening): prebuild (files/prebuild_kernels.py as the
   deploy runs it before a first start: the service user, the unit's environment; its time and
   peak host memory), cold (every cache empty but the prebuilt FlashInfer kernels), warm, and
   warm-no-autotune (as warm, plus --no-enable-flashinfer-autotune; `no-autotune` is the same
   from cold caches); after ready each run sends the
   readiness gate's warm-up (files/wait_ready.py), times the first client request after it and
   reads the prefix-cache counters of a repeated 7,000-token prompt. If the Qwen3.5 stand-in does
   not start, its Qwen3-Next twin (gpu/tiny_checkpoints.py) runs cold instead.
   Also (the third run, 2026-12-01 evening): qwen cold (empty JIT caches; the unit's MAX_JOBS,
   then 4, caps FlashInfer's ninja), qwen warm (a restart), then qwen as another box of the stack
   would start it: vLLM and FlashInfer reinstalled (new file times), every JIT cache emptied, the
   cold run's FlashInfer kernels (cached_ops/NAME/NAME.so) put into FlashInfer's own folder of
   precompiled kernels in the venv (flashinfer/data/aot/NAME/NAME.so, where flashinfer/jit/env.py
   looks when no flashinfer-jit-cache is installed; a kernel found there is loaded without
   ninja); last, the same with vLLM's torch.compile, Triton's and CUDA's caches (keyed by content
   hashes) also copied into the service user's home: what the deploy ships
   (donorkit/box/kernel_cache.py). The hermes runs and the negative control ran in the second run
   (gpu/results/h200-engine-2026-12-01/). Why not the cold run's FlashInfer cache copied as it
   is: ninja decides by file times, and its deps log records each object's time, so objects older
   than the new install's sources are rebuilt, and objects given the copy's time are rebuilt too
   ("stored deps info out of date"; ninja's graph.cc).
   Per run: start to ready (/v1/models lists the checkpoint), peak GPU memory, peak host memory,
   /version, a chat completion, 12 concurrent 256-token completions, /metrics names, the hermes
   tool call (auto and forced), and once (the first engine ready) `make accept`'s checks (--via
   loopback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from gpu.engine_box import (
    CACHE_COPY,
    ROOT,
    STAGE,
    driver_library,
    hub_cache,
    install,
    jit_modules,
    keep_caches,
    prebuild,
    service_user,
    shipped_kernels_box,
    toolkit,
    wipe_caches,
)
from gpu.engine_checks import (
    Monitor,
    first_request,
    gate_warm_up,
    http,
    prefix_cache,
    serving_checks,
)
from gpu.engine_results import table

CHUNKS, RESULTS, REPO = ROOT / "chunks", ROOT / "results", ROOT / "repo"
PROGRESS = RESULTS / "progress.log"
HERE = Path(__file__).resolve().parent.parent
CARRY = HERE / ".gpu-engine" / "carry"
UNITS = {"qwen": "render/h200-qwen/etc/systemd/system/vllm-qwen.service",
         "hermes": "render/h200-hermes/etc/systemd/system/vllm-hermes.service"}
DONORS = {"qwen": "h200-qwen", "hermes": "h200-hermes"}
READY_TIMEOUT = 600
NEGATIVE_TIMEOUT = 420
JIT_FAILURES = ("nvcc: not found", "Could not find nvcc", "cicc: command not found", "cicc",
                "ninja: build stopped", "RuntimeError", "Error", "error:")


def say(line: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with PROGRESS.open("a") as out:
        out.write(f"{stamp} {line}\n")
    print(f"{stamp} {line}", flush=True)


# ------------------------------------------------------------------ the rendered unit -----------

def read_unit(path: Path) -> tuple[str, dict[str, str], list[str]]:
    """User=, the Environment= lines in order, and ExecStart's words, as systemd reads them."""
    joined, user, env, argv = path.read_text().replace("\\\n", " "), "", {}, []
    for line in joined.splitlines():
        key, _, value = line.partition("=")
        if key == "User":
            user = value
        elif key == "Environment":
            for word in shlex.split(value):
                name, _, val = word.partition("=")
                env[name] = val
        elif key == "ExecStart":
            argv = shlex.split(value)
    return user, env, argv


def without(argv: list[str], flag: str, value: str) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv) and argv[i + 1] == value:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


# ------------------------------------------------------------------ one engine -----------------

def accept(venv: Path, name: str, port: int) -> dict:
    proc = subprocess.run([venv / "bin/python", "-m", "donorkit.commands.accept", "--donors",
                           "gpu/engine.yml", "--limit", DONORS[name], "--via",
                           f"http://127.0.0.1:{port}", "--results", str(RESULTS / "accept")],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    return {"rc": proc.returncode, "output": (proc.stdout + proc.stderr)[-1500:]}


def engine(name: str, kind: str, venv: Path, home: Path, user: str, argv: list[str],
           env: dict[str, str], timeout: int) -> dict:
    """Start one engine as the unit would, wait for ready, check it, stop it."""
    port = int(argv[argv.index("--port") + 1])
    checkpoint = argv[2]
    base = f"http://127.0.0.1:{port}"
    entry = pwd.getpwnam(user)
    full_env = {**env, "HOME": str(home), "USER": user, "LOGNAME": user,
                "SHELL": entry.pw_shell, "LANG": "C.UTF-8"}
    log_path = RESULTS / f"{name}-{kind}.log"
    if log_path.exists():  # a fallback's run keeps the first one's log
        log_path.rename(RESULTS / f"{name}-{kind}-first.log")
    say(f"{name} {kind}: starting {' '.join(argv[:3])} ... as {user}")
    with log_path.open("w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=full_env, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                user=entry.pw_uid, group=entry.pw_gid,
                                extra_groups=os.getgrouplist(user, entry.pw_gid))
        monitor = Monitor(proc.pid)
        monitor.start()
        result: dict = {"model": name, "run": kind, "checkpoint": checkpoint}
        while True:
            if proc.poll() is not None:
                result.update(outcome=f"exited {proc.returncode} after "
                                      f"{time.monotonic() - started:.1f} s before ready")
                break
            code, body = http("GET", f"{base}/v1/models", timeout=5)
            if code == 200 and f'"{checkpoint}"' in body:
                result.update(outcome="ready",
                              start_to_ready_s=round(time.monotonic() - started, 1))
                break
            if time.monotonic() - started > timeout:
                result.update(outcome=f"not ready after {timeout} s")
                break
            time.sleep(1)
        # The peaks so far in the progress line: the record is saved only after the engine has
        # stopped (up to a minute later), and a run's device time may end first (it did).
        say(f"{name} {kind}: {result['outcome']} {result.get('start_to_ready_s', '')} "
            f"(peak host {monitor.rss / 2**30:.1f} GiB, GPU {monitor.gpu_mib} MiB so far)")
        result["peak_host_gib_at_ready"] = round(monitor.rss / 2**30, 2)
        if result["outcome"] == "ready":
            result["warm_up"] = gate_warm_up(port, checkpoint, argv)
            say(f"{name} {kind}: the gate's warm-up {json.dumps(result['warm_up'])[:300]} "
                f"(peak host {monitor.rss / 2**30:.1f} GiB so far)")
            result["first_request"] = first_request(base, checkpoint)
            say(f"{name} {kind}: first client request {json.dumps(result['first_request'])}")
            result["checks"] = serving_checks(base, checkpoint, name)
            say(f"{name} {kind}: checks {json.dumps(result['checks'])[:400]}")
            if name == "qwen":
                result["prefix_cache"] = prefix_cache(base, checkpoint)
                say(f"{name} {kind}: prefix cache {json.dumps(result['prefix_cache'])[:400]}")
            if not (RESULTS / "accept").exists():  # once, on the first engine ready and warmed
                result["accept"] = accept(venv, name, port)
                say(f"{name} {kind}: accept rc={result['accept']['rc']}")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        monitor.stop = True
        monitor.join(5)
    text = log_path.read_text(errors="replace").splitlines()
    result.update(peak_gpu_mib=monitor.gpu_mib, peak_host_gib=round(monitor.rss / 2**30, 2),
                  log_tail=text[-40:],
                  jit_failure_lines=[ln for ln in text if any(s in ln for s in JIT_FAILURES)][-8:])
    time.sleep(5)  # the GPU's memory back before the next engine
    return result


# ------------------------------------------------------------------ the daemon ------------------

RUNS = ["prebuild", "cold", "warm", "warm-no-autotune", "no-autotune", "kernels-shipped",
        "kernels-and-caches-shipped"]
# The sixth run's (2026-12-03 evening): a cold start with the autotuner off did not fit the fifth
# run's device time, and the cold start's autotune step took 0.01 s; a restart with and without
# it, one after the other on the same caches, is what a box pays on every later start.
DEFAULT_RUNS = ["prebuild", "cold", "warm", "warm-no-autotune"]
WARM = ("warm", "warm-no-autotune")  # restarts: every cache kept
NO_AUTOTUNE = "--no-enable-flashinfer-autotune"  # sm_90+ only: FlashInfer's autotuner


def daemon(runs: list[str], model: str = "qwen") -> None:
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": []}

    def save() -> None:
        (RESULTS / "results.json").write_text(json.dumps(results, indent=1))

    units = {name: read_unit(STAGE / path) for name, path in UNITS.items()}
    user = units["qwen"][0]
    venv = Path(units["qwen"][2][0]).parent.parent
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    results["gpu"] = smi
    results["driver_library"] = driver_library()
    say(f"gpu: {smi}; {results['driver_library']}")
    results["install"] = install(venv)
    say(f"install: {len(results['install']['installed'])} wheels in "
        f"{results['install']['seconds']} s; import: {results['install']['import'][-200:]}")
    save()
    cuda_home = Path(units["qwen"][1]["CUDA_HOME"])
    results["toolkit"] = toolkit(cuda_home)
    say(f"toolkit: {results['toolkit']}")
    results["user"] = service_user(user, venv)
    say(f"user: {results['user']}")
    if not results["user"]["usable"]:
        results["user"]["note"] = "the image's torch is not usable by other users: engines as root"
        user = "root"
    home = Path(pwd.getpwnam(user).pw_dir)
    save()

    qwen_folder = STAGE / "models/qwen"
    plan = [(model, kind) for kind in runs]
    prebuilt = False
    for name, kind in plan:
        _, env, argv = units[name]
        env, argv = dict(env), list(argv)
        notes = []
        if name == "qwen":
            argv = without(argv, "--quantization", "exl3")
            notes.append("--quantization exl3 dropped (the operator's plugin; plain weights)")
            folder = qwen_folder
        else:
            folder = STAGE / "models/hermes"
        if kind == "prebuild":
            wipe_caches(home)
            commit = hub_cache(home, argv[2], folder, user)
            results["prebuild"] = prebuild(venv, home, user, env, argv, commit)
            prebuilt = results["prebuild"]["rc"] == 0
            say(f"prebuild: {json.dumps(results['prebuild'])[:600]}")
            save()
            continue
        if kind.startswith("kernels-"):
            if not CACHE_COPY.exists():
                continue
            shipped = shipped_kernels_box(venv, home, user, "caches" in kind)
            results[kind] = shipped
            notes.append(f"another box: fresh vLLM/FlashInfer install, empty caches, the cold "
                         f"run's {shipped['kernels']} FlashInfer kernels in the venv's "
                         f"flashinfer/data/aot, {shipped['home_caches']} copied "
                         f"({shipped['seconds']} s)")
        elif kind not in WARM:
            wipe_caches(home, keep_flashinfer=prebuilt)
            notes.append("empty caches" + (" but FlashInfer's JIT kernels the prebuild built"
                                           if prebuilt else ""))
        if kind.endswith("no-autotune"):
            argv.append(NO_AUTOTUNE)
            notes.append(f"{NO_AUTOTUNE} added (FlashInfer's autotuner off)")
        if kind == "no-nvvm-bin":
            env["PATH"] = ":".join(p for p in env["PATH"].split(":")
                                   if not p.endswith("/nvvm/bin"))
            notes.append("negative control: empty caches, PATH without nvvm/bin")
        commit = hub_cache(home, argv[2], folder, user)
        timeout = NEGATIVE_TIMEOUT if kind == "no-nvvm-bin" else READY_TIMEOUT
        before = jit_modules(home)
        run = engine(name, kind, venv, home, user, argv, env, timeout)
        after = jit_modules(home)
        run.update(notes=notes, snapshot=f"{folder.name}@{commit[:12]}",
                   environment=env, exec_start=argv,
                   jit_kernels_built_in_home=len(after),
                   jit_kernels_the_engine_built=sorted(set(after) - set(before)),
                   jit_kernels_the_engine_rebuilt=sorted(
                       name for name in set(after) & set(before) if after[name] != before[name]))
        results["runs"].append(run)
        if (name, kind) == ("qwen", "cold") and run["outcome"] == "ready":
            run["caches_kept"] = keep_caches(home)
        save()
        if name == "qwen" and kind == "cold" and run["outcome"] != "ready" \
                and qwen_folder.name == "qwen":
            say("qwen (Qwen3.5) did not start: trying the Qwen3-Next fallback of its shapes")
            qwen_folder = STAGE / "models/qwen-next"
            plan.insert(plan.index(("qwen", "cold")) + 1, ("qwen", "cold"))
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    table(RESULTS)
    say("DONE")


# ------------------------------------------------------------------ the calls -------------------

def receive() -> None:
    CHUNKS.mkdir(parents=True, exist_ok=True)
    for folder in sorted(CARRY.glob("[0-9][0-9]")):
        shutil.copy(folder / "part", CHUNKS / folder.name)
        if (folder / "manifest").exists():
            shutil.copy(folder / "manifest", CHUNKS / "manifest")
    print("chunks here:", sorted(p.name for p in CHUNKS.iterdir()))


def launch(runs: list[str], model: str = "qwen") -> None:
    count, digest = (CHUNKS / "manifest").read_text().split()
    parts = sorted(p for p in CHUNKS.iterdir() if p.name.isdigit())
    if len(parts) != int(count):
        sys.exit(f"launch: {len(parts)} of {count} chunks here")
    archive = ROOT / "stage.tar"
    sha = hashlib.sha256()
    with archive.open("wb") as out:
        for part in parts:
            data = part.read_bytes()
            sha.update(data)
            out.write(data)
    if sha.hexdigest() != digest:
        sys.exit("launch: the chunks do not add up to the archive that was built")
    shutil.rmtree(STAGE, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(ROOT, filter="tar")
    archive.unlink()
    shutil.rmtree(REPO, ignore_errors=True)  # the daemon's own copy: calls re-send the tree
    # The daemon needs the code, never a checkout's caches: the local dry run's tree may hold a
    # .testbed of 10+ GB (test_gpu_harness once filled the disk copying it).
    shutil.copytree(HERE, REPO, ignore=shutil.ignore_patterns(
        ".gpu-engine", ".git", ".venv", ".testbed", ".gpu", ".whl", ".hypothesis",
        ".pytest_cache", ".ruff_cache"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "daemon.log").open("w") as log:
        subprocess.Popen([sys.executable, "-m", "gpu.engine_run", "daemon", "--runs",
                          ",".join(runs), "--model", model], cwd=REPO,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print("launched", flush=True)


def follow(max_seconds: float) -> None:
    started, seen = time.monotonic(), 0
    while time.monotonic() - started < max_seconds:
        text = PROGRESS.read_text() if PROGRESS.exists() else ""
        print(text[seen:], end="", flush=True)
        seen = len(text)
        if "DONE" in text[-10:] or "FAILED" in text[-300:]:
            break
        time.sleep(5)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "table.md", "progress.log", "daemon.log"):
        if (RESULTS / name).exists():
            shutil.copy(RESULTS / name, out / name)
    with tarfile.open(out / "engine-logs.tar.gz", "w:gz") as tar:  # whole: phases are read off
        for path in sorted(RESULTS.glob("*-*.log")):
            tar.add(path, arcname=path.name)
    if (RESULTS / "accept").exists():
        shutil.make_archive(str(out / "accept"), "gztar", RESULTS / "accept")


def daemon_or_say(runs: list[str], model: str) -> None:
    try:
        daemon(runs, model)
    except Exception as exc:  # the follower must see it, not wait on a dead daemon
        say(f"FAILED: {type(exc).__name__}: {exc}")
        raise


def runs_list(text: str) -> list[str]:
    runs = text.split(",")
    unknown = sorted(set(runs) - set(RUNS))
    if unknown or not runs:
        raise argparse.ArgumentTypeError(f"unknown run(s) {', '.join(unknown)}: "
                                         f"choose from {', '.join(RUNS)}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["receive", "launch", "follow", "daemon", "table"])
    parser.add_argument("--max", type=float, default=540, help="follow: seconds at most")
    parser.add_argument("--runs", type=runs_list, default=DEFAULT_RUNS, help=(
        "launch: the model's runs, in order, a comma list of " + ", ".join(RUNS) +
        f" (default: {','.join(DEFAULT_RUNS)}); the shipped ones need a cold run first"))
    parser.add_argument("--model", choices=sorted(UNITS), default="qwen", help=(
        "launch: whose unit the runs start (default qwen; hermes: the sixth run's, when the "
        "device time left was under a qwen cold start and its warm-up)"))
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="table: a results folder (results.json and the engines' logs)")
    args = parser.parse_args()
    {"receive": receive, "launch": lambda: launch(args.runs, args.model),
     "daemon": lambda: daemon_or_say(args.runs, args.model),
     "table": lambda: table(args.results),
     "follow": lambda: follow(args.max)}[args.step]()


if __name__ == "__main__":
    main()
