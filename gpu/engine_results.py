"""gpu/engine_run.py's results read back: an engine's start phases from its log (vLLM's and
FlashInfer's own lines) and the results folder's table.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

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


def table(results_dir: Path) -> None:
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
