"""What gpu/engine_run.py measures of a running engine: peak GPU and host memory while it starts,
and the serving checks once it is ready (/version, a chat completion, 12 concurrent 256-token
completions, /metrics names, the hermes tool call, auto and forced)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


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


def _gate():
    """files/wait_ready.py, the deploy's readiness gate, as a module (its warm-up runs here)."""
    path = Path(__file__).resolve().parent.parent / "files/wait_ready.py"
    spec = importlib.util.spec_from_file_location("wait_ready", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gate_warm_up(port: int, model: str, argv: list[str], timeout: float = 600) -> dict:
    """The readiness gate's warm-up, as the deploy sends it once the model is listed, timed."""
    def option(name: str, default: int) -> int:
        return int(argv[argv.index(name) + 1]) if name in argv else default
    seqs, max_len = option("--max-num-seqs", 1), option("--max-model-len", 4096)
    started = time.monotonic()
    why = _gate().warm_up(port, model, seqs, max_len, timeout)
    return {"seconds": round(time.monotonic() - started, 1), "failed": why,
            "requests": seqs + 2}


def first_request(base: str, model: str) -> dict:
    """What the first client after ready pays: one chat completion, timed."""
    chat = {"model": model, "messages": [{"role": "user", "content": "What is a GPU?"}],
            "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False}}
    started = time.monotonic()
    code, _ = http("POST", f"{base}/v1/chat/completions", chat, timeout=600)
    return {"status": code, "seconds": round(time.monotonic() - started, 2)}


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", metrics, re.M))


def prefix_cache(base: str, model: str, tokens: int = 7000) -> dict:
    """The same long prompt twice (byte-level stand-in tokenizer: a character is a token):
    vLLM's prefix-cache counters in /metrics before and after (full 1600-token blocks hit)."""
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(tokens))
    one = {"model": model, "prompt": prompt, "max_tokens": 4}
    before = http("GET", f"{base}/metrics")[1]
    codes, times = [], []
    for _ in range(2):
        started = time.monotonic()
        codes.append(http("POST", f"{base}/v1/completions", one, timeout=300)[0])
        times.append(round(time.monotonic() - started, 2))
    after = http("GET", f"{base}/metrics")[1]
    names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    return {"status": codes, "seconds": times, **{
        n.split(":")[1]: _counter(after, n) - _counter(before, n) for n in names},
        "lines": [ln for ln in after.splitlines() if "prefix_cache" in ln
                  and not ln.startswith("#")][:8]}
