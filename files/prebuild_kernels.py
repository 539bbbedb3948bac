"""Build the FlashInfer JIT kernels a vLLM unit will need, before the unit starts, outside its
cgroup: the engine's own first start then finds them and stays under the unit's MemoryMax.

Run on the box by the deploy as the service user with the unit's environment and the venv's
python (the kernels land where the engine looks, built with the compiler and flags ninja
compares), for the card profile's `--arch`: no GPU is touched, the old engine may still serve.
Prints one JSON line (the jobs, each module built or already there, the seconds); in a venv
without torch or FlashInfer (the testbed's stand-in) it builds nothing. Exit 1 with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
          "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def head_dim(config: dict) -> int:
    text = text_config(config)
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def model_dtype(config: dict, dtype: str) -> str:
    """vLLM's --dtype auto: the checkpoint's own (float16 for these; bfloat16 stays)."""
    if dtype != "auto":
        return DTYPES[dtype]
    text = text_config(config)
    found = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float16"
    return "bfloat16" if found == "bfloat16" else "float16"


def jobs(gib_per_job: float, reserve_gib: float, meminfo: str = "/proc/meminfo") -> int:
    """Compile jobs (FlashInfer passes MAX_JOBS to ninja as -j): the box's MemAvailable less
    `reserve_gib`, over `gib_per_job` (docs/benchmarks.md), at least 1, at most the CPU count."""
    fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines()
                  if ":" in line)
    available_gib = int(fields["MemAvailable"].split()[0]) / 2**20
    return max(1, min(os.cpu_count() or 1, int((available_gib - reserve_gib) // gib_per_job)))


def specs(head: int, q: str, kv: str, arch: str) -> list:
    """The modules, as FlashInfer's JIT specs (imported here: torch and FlashInfer load slowly).

    FlashInfer 0.6.14's own generators, flashinfer/aot.py's choice for one head size and one
    dtype pair, as vLLM 0.26.0's FlashInfer backend asks for them: the paged batch-prefill and
    batch-decode modules (FA2) for the query dtype over the KV-cache dtype, on sm_90 and newer
    also FA3's batch prefill for the dtype vLLM gives the query there (the KV dtype: fp8 with an
    fp8 cache), and the sampling module (top-k/top-p). `head` is the checkpoint's (head_dim)."""
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.sampling import gen_sampling_module

    dq, dkv, i32 = getattr(torch, q), getattr(torch, kv), torch.int32
    common = dict(head_dim_qk=head, head_dim_vo=head, pos_encoding_mode=0,
                  use_sliding_window=False, use_logits_soft_cap=False)
    out = [gen_batch_prefill_module("fa2", dq, dkv, dq, i32, use_fp16_qk_reduction=False,
                                    **common),
           gen_batch_decode_module(dq, dkv, dq, i32, **common)]
    if int(arch.split(".")[0]) >= 9:  # FA3 (Hopper): one dtype for query and cache
        out.append(gen_batch_prefill_module("fa3", dkv, dkv, dq, i32,
                                            use_fp16_qk_reduction=False, **common))
    out.append(gen_sampling_module())
    return out


def build_like_the_engine(spec) -> str:
    """One module built in its own folder, as the engine builds it when it loads it
    (JitSpec.build: `ninja -C cached_ops/NAME`), so ninja's state (.ninja_deps, .ninja_log)
    lies where the engine's ninja reads it and the engine finds nothing to do. FlashInfer's
    build_jit_specs (one ninja over subninjas, which this used until 0.19.1) keeps that state in
    cached_ops/ alone; the engine's ninja then finds none in the module's folder and rebuilds
    every object ("deps for ... are missing": gpu/prebuild_ninja_check.py, with FlashInfer's own
    build files, ninja 1.13.2 and nvcc 13.3): the hermes unit's cold start on the H200 on
    2026-12-03 spent 420 s of FlashInfer's autotune step rebuilding the prebuilt FA3 module
    with the unit's MAX_JOBS=2 (gpu/results/h200-engine-2026-12-03-evening/). Modules one
    after another, MAX_JOBS each: the jobs stay what the box's memory allows. Returns "built",
    or "up to date" where ninja had nothing to do (the library's file unchanged)."""
    library = spec.jit_library_path

    def stamp() -> tuple[int, int] | None:
        try:
            found = library.stat()
        except FileNotFoundError:
            return None
        return (found.st_ino, found.st_mtime_ns)

    before = stamp()
    spec.build(verbose=False)
    return "up to date" if before is not None and stamp() == before else "built"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the checkpoint's config.json")
    parser.add_argument("--dtype", required=True, help="the unit's --dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the unit's --kv-cache-dtype")
    parser.add_argument("--arch", required=True, help="the card's compute capability, e.g. 8.9")
    parser.add_argument("--gib-per-job", type=float, required=True)
    parser.add_argument("--reserve-gib", type=float, default=4.0)
    parser.add_argument("--dry-run", action="store_true", help="say what, build nothing")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config.read_text())
        head = head_dim(config)
        q = model_dtype(config, args.dtype)
        kv = q if args.kv_cache_dtype == "auto" else DTYPES[args.kv_cache_dtype]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"prebuild_kernels: {args.config}: cannot read the model's shape: {exc}",
              file=sys.stderr)
        return 1
    n = jobs(args.gib_per_job, args.reserve_gib)
    os.environ["MAX_JOBS"] = str(n)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.arch  # read when FlashInfer is imported
    started = time.monotonic()
    try:
        wanted = specs(head, q, kv, args.arch)
    except ImportError as exc:  # vLLM 0.26.0 pins flashinfer-python: a venv without is no engine's
        print(json.dumps({"jobs": n, "modules": {}, "skipped": f"no FlashInfer in this venv "
                          f"({exc.name}): nothing to build"}), flush=True)
        return 0
    report = {"jobs": n, "head_dim": head, "q": q, "kv": kv, "arch": args.arch,
              "modules": {s.name: ("shipped" if s.is_aot else "to build") for s in wanted}}
    if not args.dry_run:
        for spec in wanted:
            if spec.is_aot:  # the deploy's shipped kernels (flashinfer/data/aot): no ninja runs
                continue
            try:
                report["modules"][spec.name] = build_like_the_engine(spec)
            except Exception as exc:  # ninja's failure: one line, the module's name
                print(f"prebuild_kernels: building {spec.name} failed: {type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1:]}", file=sys.stderr)
                return 1
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
