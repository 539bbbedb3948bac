"""The real vLLM 0.26.0 engine, started from the units `make render` writes, on the lent GPU
machine (the `device` tool's H200: torch 2.11.0+cu130, no vLLM, no network, no systemd).

    python3 gpu/engine_run.py receive     # each carry call: keep .gpu-engine/carry/NN/part
    python3 gpu/engine_run.py launch      # unpack, then run everything in the background
    python3 gpu/engine_run.py follow      # print progress until done (or --max seconds)

Built on the operator's machine by gpu/engine_carry.py; the README's "The real engine on a GPU"
gives the calls. What runs, in order (the background daemon; results under /root/engine/results,
copied to $OUT by `follow`):
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
   Runs (the third run, 2026-12-01 evening): qwen cold (empty JIT caches; the unit's MAX_JOBS,
   then 4, caps FlashInfer's ninja), qwen warm (a restart), then qwen as another box of the stack
   would start it: vLLM and FlashInfer reinstalled (new file times), every JIT cache emptied, the
   cold run's FlashInfer kernels (cached_ops/NAME/NAME.so) put into FlashInfer's own folder of
   precompiled kernels in the venv (flashinfer/data/aot/NAME/NAME.so, where flashinfer/jit/env.py
   looks when no flashinfer-jit-cache is installed; a kernel found there is loaded without
   ninja); last, the same with vLLM's torch.compile, Triton's and CUDA's caches (keyed by content
   hashes) also copied into the service user's home: what the deploy ships
   (donorkit/kernel_cache.py). The hermes runs and the negative control ran in the second run
   (gpu/results/h200-engine-2026-12-01/). Why not the cold run's FlashInfer cache copied as it
   is: ninja decides by file times, and its deps log records each object's time, so objects older
   than the new install's sources are rebuilt, and objects given the copy's time are rebuilt too
   ("stored deps info out of date"; ninja's graph.cc).
   Per run: start to ready (/v1/models lists the checkpoint), peak GPU memory, peak host memory,
   /version, a chat completion, 12 concurrent 256-token completions, /metrics names, the hermes
   tool call (auto and forced), and on warm runs `make accept`'s engine checks (--via loopback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path("/root/engine")
CHUNKS, STAGE, RESULTS, REPO = ROOT / "chunks", ROOT / "stage", ROOT / "results", ROOT / "repo"
PROGRESS = RESULTS / "progress.log"
CACHE_COPY = ROOT / "qwen-caches.tar"
HERE = Path(__file__).resolve().parent.parent
CARRY = HERE / ".gpu-engine" / "carry"
UNITS = {"qwen": "render/h200-qwen/etc/systemd/system/vllm-qwen.service",
         "hermes": "render/h200-hermes/etc/systemd/system/vllm-hermes.service"}
DONORS = {"qwen": "h200-qwen", "hermes": "h200-hermes"}
RETENTION = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
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


# ------------------------------------------------------------------ set-up ----------------------

def install(venv: Path) -> dict:
    started = time.monotonic()
    image_site = subprocess.run(
        ["python3", "-c", "import os, torch; print(os.path.dirname(os.path.dirname("
         "torch.__file__)))"], capture_output=True, text=True, check=True).stdout.strip()
    if not (venv / "bin/python").exists():
        subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig."
                           "get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    Path(site, "image-site.pth").write_text(image_site + "\n")
    table = json.loads((STAGE / "requirements.json").read_text())["carried"]
    check = (
        "import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
        "from packaging.specifiers import SpecifierSet\n"
        "table = json.load(open(sys.argv[1]))['carried']\nneed = []\n"
        "for name, e in sorted(table.items()):\n"
        "    try:\n        have = version(name)\n    except PackageNotFoundError:\n"
        "        have = None\n"
        "    ok = have is not None and all(have in SpecifierSet(s, prereleases=True) "
        "for s in e['specifiers'])\n"
        "    if not ok or name in ('vllm', 'ninja'):\n        need.append([name, have])\n"
        "print(json.dumps(need))\n")
    need = json.loads(subprocess.run([venv / "bin/python", "-c", check,
                                      STAGE / "requirements.json"], capture_output=True,
                                     text=True, check=True).stdout)
    wheels = [str(STAGE / "wheels" / table[name]["wheel"]) for name, _ in need]
    # --ignore-installed: ninja and vllm go into the venv even where the image has them.
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", "--no-compile", "--disable-pip-version-check", *wheels],
                   check=True)
    os.chmod(venv, 0o755)
    probe = subprocess.run([venv / "bin/python", "-c", "import vllm, vllm.entrypoints.openai."
                            "api_server; print(vllm.__version__)"], capture_output=True, text=True)
    return {"import": (probe.stdout + probe.stderr).strip()[-600:],
            "installed": {n: [h, table[n]["version"]] for n, h in need},
            "seconds": round(time.monotonic() - started, 1), "image_site": image_site}


def driver_library() -> str:
    """A donor's driver puts libcuda in the loader's path; this image mounts it elsewhere and
    finds it through its own LD_LIBRARY_PATH, which a unit's LD_LIBRARY_PATH replaces. Register
    its folder with ld.so, as a driver install does (the units stay as rendered)."""
    if "libcuda.so.1" in subprocess.run(["ldconfig", "-p"], capture_output=True,
                                        text=True).stdout:
        return "libcuda.so.1 already in ld.so's cache"
    found = [d for d in (os.environ.get("LD_LIBRARY_PATH", "").split(":") +
                         ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"])
             if d and Path(d, "libcuda.so.1").exists()]
    if not found:
        return "libcuda.so.1 not found"
    Path("/etc/ld.so.conf.d/zz-nvidia-driver.conf").write_text(found[0] + "\n")
    subprocess.run(["ldconfig"], check=True)
    return f"registered {found[0]} with ld.so"


def toolkit(prefix: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.testbed.cuda_standin import _finish_layout, _unpack_wheel

    started = time.monotonic()
    if not (prefix / "bin/nvcc").exists():
        for wheel in sorted((STAGE / "cuda-13.3").glob("*.whl")):
            _unpack_wheel(wheel, prefix)
        _finish_layout(prefix, prefix.name.removeprefix("cuda-"))
    nvcc = subprocess.run([prefix / "bin/nvcc", "--version"], capture_output=True, text=True)
    return {"nvcc": nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else nvcc.stderr,
            "cicc": (prefix / "nvvm/bin/cicc").exists(),
            "seconds": round(time.monotonic() - started, 1)}


def service_user(name: str, venv: Path) -> dict:
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True)
    probe = subprocess.run(["runuser", "-u", name, "--", str(venv / "bin/python"), "-c",
                            "import torch, vllm; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    usable = probe.returncode == 0 and probe.stdout.strip() == "True"
    return {"user": name, "usable": usable, "probe": (probe.stdout + probe.stderr)[-400:]}


def hub_cache(home: Path, checkpoint: str, folder: Path, owner: str) -> str:
    """The checkpoint as the weights step leaves it: snapshots/<commit>/ and refs/main."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(hashlib.sha256(p.read_bytes()).digest()
                                   for p in files)).hexdigest()
    repo = home / ".cache/huggingface/hub" / f"models--{checkpoint.replace('/', '--')}"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(commit)
    for path in files:
        shutil.copy(path, repo / "snapshots" / commit / path.name)
    subprocess.run(["chown", "-R", f"{owner}:{owner}", str(home / ".cache")], check=True)
    return commit


def jit_caches(home: Path) -> list[Path]:
    """The JIT caches (FlashInfer's, vLLM's torch.compile, Triton's, CUDA's): not the weights."""
    return [p for p in [*(home / ".cache").glob("*"), home / ".triton", home / ".nv"]
            if p.name != "huggingface" and p.exists()]


def wipe_caches(home: Path) -> None:
    for path in jit_caches(home):
        shutil.rmtree(path, ignore_errors=True)


def keep_caches(home: Path) -> dict:
    """A copy of the caches a cold start left, as an operator's machine would fetch them."""
    with tarfile.open(CACHE_COPY, "w") as tar:
        for path in jit_caches(home):
            tar.add(path, arcname=str(path.relative_to(home)))
    return {"bytes": CACHE_COPY.stat().st_size}


def flashinfer_package(venv: Path) -> Path:
    found = subprocess.run([venv / "bin/python", "-c", "import importlib.util as u; "
                            "print(u.find_spec('flashinfer').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return Path(found)


def shipped_kernels_box(venv: Path, home: Path, owner: str, home_caches: bool) -> dict:
    """Another box of the stack, as the deploy ships it the stack's kernels before its unit
    starts: vLLM and FlashInfer installed afresh (new file times), every JIT cache emptied, the
    cold box's FlashInfer kernels in FlashInfer's precompiled-kernel folder of the venv; with
    `home_caches`, also vLLM's torch.compile and Triton caches in the service user's home (what
    the deploy does not ship: the remainder they would save)."""
    started = time.monotonic()
    table = json.loads((STAGE / "requirements.json").read_text())["carried"]
    wheels = [str(STAGE / "wheels" / table[n]["wheel"]) for n in ("vllm", "flashinfer-python")]
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", "--no-compile", "--disable-pip-version-check", *wheels],
                   check=True)
    wipe_caches(home)
    aot = flashinfer_package(venv) / "data" / "aot"
    shipped, other = 0, []
    with tarfile.open(CACHE_COPY) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if parts[:2] == (".cache", "flashinfer"):
                # .cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so
                if member.isfile() and len(parts) == 7 and parts[4] == "cached_ops" \
                        and parts[6] == f"{parts[5]}.so":
                    target = aot / parts[5] / parts[6]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    target.chmod(0o644)
                    shipped += 1
            elif home_caches:
                other.append(member)
        tar.extractall(home, members=other, filter="tar")
    subprocess.run(["chown", "-R", f"{owner}:{owner}", str(home)], check=True)
    return {"seconds": round(time.monotonic() - started, 1), "kernels": shipped,
            "kernel_bytes": sum(f.stat().st_size for f in aot.rglob("*.so")),
            "home_caches": sorted({Path(m.name).parts[0] + "/" + Path(m.name).parts[1]
                                   for m in other if len(Path(m.name).parts) > 1})}


# ------------------------------------------------------------------ one engine -----------------

class Monitor(threading.Thread):
    """Peak GPU memory used (nvidia-smi) and peak host memory of the engine's processes."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.gpu_mib, self.rss, self.stop = pid, 0, 0, False

    def run(self) -> None:
        import psutil
        while not self.stop:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True).stdout.split()
            if out:
                self.gpu_mib = max(self.gpu_mib, int(out[0]))
            try:
                main = psutil.Process(self.pid)
                procs = [main, *main.children(recursive=True)]
                self.rss = max(self.rss, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            time.sleep(1)


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def serving_checks(base: str, model: str, name: str) -> dict:
    checks: dict = {}
    code, body = http("GET", f"{base}/version")
    checks["version"] = json.loads(body).get("version") if code == 200 else f"HTTP {code}"
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False}}
    code, body = http("POST", f"{base}/v1/chat/completions", chat)
    checks["chat"] = {"status": code, "completion_tokens":
                      json.loads(body)["usage"]["completion_tokens"] if code == 200 else body[:300]}
    one = {"model": model, "prompt": "The quick brown fox", "max_tokens": 256, "ignore_eos": True}
    started = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda _: http("POST", f"{base}/v1/completions", one)[0], range(12)))
    checks["concurrent_12x256"] = {"ok": codes.count(200),
                                   "wall_s": round(time.monotonic() - started, 2)}
    code, body = http("GET", f"{base}/metrics")
    checks["metrics"] = {n: (n + "{" in body or n + " " in body) for n in (
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc")}
    if name == "hermes":
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}
        ask = {"model": model, "max_tokens": 64, "tools": [tool],
               "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        code, body = http("POST", f"{base}/v1/chat/completions", {**ask, "tool_choice": "auto"})
        checks["tool_auto"] = {"status": code, "body": body[:300] if code != 200 else "ok"}
        forced = {**ask, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        code, body = http("POST", f"{base}/v1/chat/completions", forced)
        calls = json.loads(body)["choices"][0]["message"].get("tool_calls") if code == 200 else None
        checks["tool_forced"] = {"status": code, "tool_calls": calls or body[:300]}
    return checks


def accept(venv: Path, name: str, port: int) -> dict:
    proc = subprocess.run([venv / "bin/python", "-m", "donorkit.accept", "--donors",
                           "gpu/engine.yml", "--limit", DONORS[name], "--via",
                           f"http://127.0.0.1:{port}", "--results", str(RESULTS / "accept")],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
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
        say(f"{name} {kind}: {result['outcome']} {result.get('start_to_ready_s', '')}")
        if result["outcome"] == "ready":
            result["checks"] = serving_checks(base, checkpoint, name)
            say(f"{name} {kind}: checks {json.dumps(result['checks'])[:400]}")
            if kind == "warm":
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

def daemon() -> None:
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
    plan = [("qwen", "cold"), ("qwen", "warm"), ("qwen", "kernels-shipped"),
            ("qwen", "kernels-and-caches-shipped")]
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
        if qwen_folder.name == "qwen-dense" and name == "qwen":
            env.pop(RETENTION, None)
            notes.append(f"dense fallback: {RETENTION} dropped (no Mamba layers)")
        if kind.startswith("kernels-"):
            if not CACHE_COPY.exists():
                continue
            shipped = shipped_kernels_box(venv, home, user, "caches" in kind)
            results[kind] = shipped
            notes.append(f"another box: fresh vLLM/FlashInfer install, empty caches, the cold "
                         f"run's {shipped['kernels']} FlashInfer kernels in the venv's "
                         f"flashinfer/data/aot, {shipped['home_caches']} copied "
                         f"({shipped['seconds']} s)")
        elif kind != "warm":
            wipe_caches(home)
        if kind == "no-nvvm-bin":
            env["PATH"] = ":".join(p for p in env["PATH"].split(":")
                                   if not p.endswith("/nvvm/bin"))
            notes.append("negative control: empty caches, PATH without nvvm/bin")
        commit = hub_cache(home, argv[2], folder, user)
        timeout = NEGATIVE_TIMEOUT if kind == "no-nvvm-bin" else READY_TIMEOUT
        run = engine(name, kind, venv, home, user, argv, env, timeout)
        run.update(notes=notes, snapshot=f"{folder.name}@{commit[:12]}",
                   environment=env, exec_start=argv,
                   jit_kernels_built_in_home=len(list(
                       (home / ".cache/flashinfer").glob("*/*/cached_ops/*/*.so"))))
        results["runs"].append(run)
        if (name, kind) == ("qwen", "cold") and run["outcome"] == "ready":
            run["caches_kept"] = keep_caches(home)
        save()
        if name == "qwen" and kind == "cold" and run["outcome"] != "ready" \
                and qwen_folder.name == "qwen":
            say("qwen hybrid did not start: trying the dense fallback")
            qwen_folder = STAGE / "models/qwen-dense"
            plan.insert(plan.index(("qwen", "warm")), ("qwen", "cold"))
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    table()
    say("DONE")


STAMP = re.compile(r"(?:^|\s)(?:\d{2}-\d{2}|\d{4}-\d{2}-\d{2}) (\d{2}):(\d{2}):(\d{2})[ ,]")
MARKS = {"autotune_start": "Autotuning process starts",
         "autotune_end": "Autotuning process ends",
         "attention_warmup": "Warming up FlashInfer attention",
         "graphs": "Graph capturing finished",
         "jit_monitor": "Kernel JIT monitor activated"}


def phases(log: str) -> dict:
    """Where an engine's start went, from vLLM's own log lines: torch.compile and the engine's
    init as vLLM reports them; FlashInfer's JIT under the autotuner, its attention warmup, and
    the quiet stretch after CUDA graphs until the JIT monitor starts, from the lines' times."""
    seen: dict[str, int] = {}
    out: dict = {}
    for line in log.splitlines():
        if m := re.search(r"torch\.compile took ([\d.]+) s in total", line):
            out["torch_compile_s"] = float(m.group(1))
        if m := re.search(r"init engine \(.*\) took ([\d.]+) s", line):
            out["init_engine_s"] = float(m.group(1))
        stamp = STAMP.search(line)
        for key, text in MARKS.items():
            if text in line and stamp and key not in seen:
                h, mi, se = map(int, stamp.groups())
                seen[key] = h * 3600 + mi * 60 + se
    spans = {"flashinfer_autotune_s": ("autotune_start", "autotune_end"),
             "attention_warmup_s": ("attention_warmup", "graphs"),
             "after_graphs_s": ("graphs", "jit_monitor")}
    for name, (start, end) in spans.items():
        if start in seen and end in seen:
            out[name] = (seen[end] - seen[start]) % 86400
    return out


def table(results_dir: Path = RESULTS) -> None:
    results = json.loads((results_dir / "results.json").read_text())
    lines = [f"GPU: {results.get('gpu')}", "",
             "| engine | run | outcome | start to ready (s) | init engine (s) | torch.compile (s) "
             "| FlashInfer JIT+autotune (s) | attention warmup (s) | after graphs (s) "
             "| peak GPU MiB | peak host GiB | chat | 12x256 wall (s) | tool call (forced) "
             "| accept rc |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = results["runs"]
    for i, r in enumerate(runs):
        c = r.get("checks", {})
        forced = c.get("tool_forced", {}).get("tool_calls")
        later = any((x["model"], x["run"]) == (r["model"], r["run"]) for x in runs[i + 1:])
        log = results_dir / f"{r['model']}-{r['run']}{'-first' if later else ''}.log"
        ph = phases(log.read_text(errors="replace")) if log.exists() else {}
        lines.append(
            f"| {r['model']} ({r.get('snapshot', '')}) | {r['run']} | {r['outcome']} | "
            f"{r.get('start_to_ready_s', '')} | {ph.get('init_engine_s', '')} | "
            f"{ph.get('torch_compile_s', '')} | {ph.get('flashinfer_autotune_s', '')} | "
            f"{ph.get('attention_warmup_s', '')} | {ph.get('after_graphs_s', '')} | "
            f"{r['peak_gpu_mib']} | {r['peak_host_gib']} | "
            f"{c.get('chat', {}).get('status', '')} | "
            f"{c.get('concurrent_12x256', {}).get('wall_s', '')} | "
            f"{'parsed' if isinstance(forced, list) else ('not parsed' if forced else '')} | "
            f"{r.get('accept', {}).get('rc', '')} |")
    (results_dir / "table.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------ the calls -------------------

def receive() -> None:
    CHUNKS.mkdir(parents=True, exist_ok=True)
    for folder in sorted(CARRY.glob("[0-9][0-9]")):
        shutil.copy(folder / "part", CHUNKS / folder.name)
        if (folder / "manifest").exists():
            shutil.copy(folder / "manifest", CHUNKS / "manifest")
    print("chunks here:", sorted(p.name for p in CHUNKS.iterdir()))


def launch() -> None:
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
    shutil.copytree(HERE, REPO, ignore=shutil.ignore_patterns(".gpu-engine", ".git", ".venv"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "daemon.log").open("w") as log:
        subprocess.Popen([sys.executable, str(REPO / "gpu/engine_run.py"), "daemon"], cwd=REPO,
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


def daemon_or_say() -> None:
    try:
        daemon()
    except Exception as exc:  # the follower must see it, not wait on a dead daemon
        say(f"FAILED: {type(exc).__name__}: {exc}")
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["receive", "launch", "follow", "daemon", "table"])
    parser.add_argument("--max", type=float, default=540, help="follow: seconds at most")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="table: a results folder (results.json and the engines' logs)")
    args = parser.parse_args()
    {"receive": receive, "launch": launch, "daemon": daemon_or_say,
     "table": lambda: table(args.results),
     "follow": lambda: follow(args.max)}[args.step]()


if __name__ == "__main__":
    main()
