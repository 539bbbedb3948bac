"""What gpu/engine_run.py measures of a running engine: peak GPU and host memory while it starts,
and the serving checks once it is ready (/version, a chat completion, 12 concurrent 256-token
completions, /metrics names, the hermes tool call, auto and forced)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


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
