"""FlashInfer's own build, checked on this CPU-only machine: after files/prebuild_kernels.py's
prebuild (build_like_the_engine) the engine's build of the module finds nothing to do; after
FlashInfer's build_jit_specs (the old prebuild) it compiles every object again.

Usage: python3 -m gpu.prebuild_ninja_check [--work /tmp/prebuild-ninja-check] [--jobs 2]

Real parts only: FlashInfer 0.6.14 and ninja 1.13.2 from the engine's carried wheels
(.gpu-engine/stage/wheels, `make gpu-engine-carry`), NVIDIA's CUDA 13.3 compiler wheels
(.gpu-engine/stage/cuda-13.3) laid out as gpu/engine_box.py's toolkit() lays them out, and
FlashInfer's small sampling module (jit/sampling.py gen_sampling_module) compiled for sm_89
(FLASHINFER_CUDA_ARCH_LIST=8.9, an RTX 4090). Nothing is loaded on a GPU: spec.build() only.

Under --work (reused when present): venv/ (python3.11: the CPU torch 2.13.0 on this disk,
which flashinfer.jit imports; apache-tvm-ffi 0.1.10's cp311 wheel and numpy from PyPI, the
carried ones being cp312; the rest of what FlashInfer imports from the carried wheels, with
--no-deps: the CuTe-DSL, cuDNN-frontend and cuda-tile wheels it lists are not on the JIT
path), cuda-13.3/ and, as lib64/stubs/libcuda.so, a STAND-IN for the driver's link stub
(FlashInfer links with -lcuda; NVIDIA ships the stub in cuda-driver-dev, no wheel carries it;
the link only needs the name, nothing is loaded). Each way builds in a fresh workspace,
ws-old/ and ws-new/: FlashInfer 0.6.14 puts its JIT folder under FLASHINFER_WORKSPACE_BASE
(flashinfer/jit/env.py line 52), in .cache/flashinfer/0.6.14/89/cached_ops/.

  (a) old: build_jit_specs([sampling]), then the engine's spec.build(verbose=False)
  (b) new: build_like_the_engine(sampling) (imported from files/prebuild_kernels.py by path),
      the engine's spec.build(verbose=False), then build_like_the_engine once more.

Before the engine's step, `ninja -n -d explain` in the module's folder (the engine's
`ninja -C cached_ops/sampling`) says what ninja would run and why; the objects' and the
library's mtimes before and after the engine's step say what it did. Prints a table and one
JSON line; exit 0 only if (a)'s engine step rebuilt, (b)'s did not and (b)'s second prebuild
said "up to date". A worker (--worker) runs each way in the venv.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".gpu-engine/stage"
MAIN_STAGE = Path("/work/main/.gpu-engine/stage")
ARCH = "8.9"
TORCH = "torch==2.13.0"  # the CPU build on this disk (pip takes it; python.md)
FROM_PYPI = ["apache-tvm-ffi==0.1.10", "numpy==2.3.5", "charset-normalizer==3.5.3"]  # cp311
CARRIED = ["flashinfer_python-0.6.14-", "ninja-1.13.2-", "filelock-", "packaging-", "einops-",
           "click-", "tabulate-", "tqdm-", "nvidia_ml_py-", "typing_extensions-", "requests-",
           "urllib3-", "idna-", "certifi-"]


def stage() -> Path:
    return STAGE if (STAGE / "wheels").is_dir() else MAIN_STAGE


def venv(work: Path, python: str) -> Path:
    folder = work / "venv"
    wheels = [w for prefix in CARRIED for w in sorted((stage() / "wheels").glob(prefix + "*.whl"))]
    if len(wheels) != len(CARRIED):
        sys.exit(f"prebuild_ninja_check: {stage()}/wheels: carried wheels missing "
                 "(make gpu-engine-carry)")
    key = json.dumps([TORCH, *FROM_PYPI, *(w.name for w in wheels)])
    ready = folder / ".ready"
    if ready.exists() and ready.read_text() == key:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([python, "-m", "venv", folder], check=True)
    pip = [folder / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for step in ([*pip, TORCH], [*pip, "--no-deps", *wheels, *FROM_PYPI]):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"prebuild_ninja_check: {' '.join(map(str, step))} failed:\n"
                     f"{done.stderr[-2000:]}")
    ready.write_text(key)
    return folder


def toolkit(work: Path) -> Path:
    from tests.support.cuda_standin import finish_layout, unpack_wheel

    prefix = work / "cuda-13.3"
    if not (prefix / "bin/nvcc").exists():
        shutil.rmtree(prefix, ignore_errors=True)
        for wheel in sorted((stage() / "cuda-13.3").glob("*.whl")):
            unpack_wheel(wheel, prefix)
        finish_layout(prefix, "13.3")
    stub = prefix / "lib64/stubs/libcuda.so"
    if not stub.exists():  # STAND-IN for the driver's link stub: a library with no symbols
        stub.parent.mkdir(parents=True, exist_ok=True)
        empty = work / "empty.c"
        empty.write_text("")
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub,
                        empty], check=True)
    return prefix


def files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file in the module's folder: (inode, size, mtime_ns)."""
    return {p.name: (s.st_ino, s.st_size, s.st_mtime_ns)
            for p in sorted(folder.iterdir()) if p.is_file() for s in [p.stat()]}


def worker(way: str) -> dict:
    """One way, in this venv, in the workspace the parent set (FLASHINFER_WORKSPACE_BASE)."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import build_jit_specs
    from flashinfer.jit.sampling import gen_sampling_module

    found = importlib.util.spec_from_file_location("prebuild_kernels",
                                                   ROOT / "files/prebuild_kernels.py")
    prebuild = importlib.util.module_from_spec(found)
    found.loader.exec_module(prebuild)

    spec = gen_sampling_module()
    out: dict = {"way": way, "module": spec.name, "jit_dir": str(jit_env.FLASHINFER_JIT_DIR)}
    started = time.monotonic()
    if way == "old":
        build_jit_specs([spec], verbose=False)
        out["prebuild"] = "build_jit_specs"
    else:
        out["prebuild"] = f"build_like_the_engine: {prebuild.build_like_the_engine(spec)}"
    out["prebuild_s"] = round(time.monotonic() - started, 1)
    folder = spec.build_dir
    out["ninja_logs"] = sorted(str(p.relative_to(jit_env.FLASHINFER_JIT_DIR))
                               for p in jit_env.FLASHINFER_JIT_DIR.rglob(".ninja_log"))
    out["build_ninja"] = spec.ninja_path.read_text().replace(
        str(jit_env.FLASHINFER_BASE_DIR), "$WS")

    before = files(folder)
    explain = subprocess.run(["ninja", "-n", "-d", "explain", "-C", str(folder), "-f",
                              str(spec.ninja_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out["dry_run_left_folder_alone"] = files(folder) == before
    text = explain.stdout.replace(str(jit_env.FLASHINFER_JIT_DIR), "$JIT")
    out["explain"] = [line[:160] for line in text.splitlines()]
    out["would_run"] = len(re.findall(r"^\[\d+/\d+\]", text, re.M))

    started = time.monotonic()
    spec.build(verbose=False)  # what the engine's build_and_load does before it loads
    out["engine_s"] = round(time.monotonic() - started, 1)
    after = files(folder)
    built = [n for n in after if n.endswith((".o", ".so"))]
    out["engine_rebuilt"] = sorted(n for n in built if before.get(n) != after[n])
    out["build_ninja_rewritten"] = before.get("build.ninja") != after.get("build.ninja")
    if way == "new":
        started = time.monotonic()
        out["second_prebuild"] = prebuild.build_like_the_engine(spec)
        out["second_prebuild_s"] = round(time.monotonic() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/prebuild-ninja-check"))
    parser.add_argument("--jobs", default="2", help="MAX_JOBS, FlashInfer's ninja -j")
    parser.add_argument("--python", default="python3.11", help="the venv's interpreter")
    parser.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)), flush=True)
        return 0

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    folder = venv(work, args.python)
    cuda = toolkit(work)
    nvcc = subprocess.run([cuda / "bin/nvcc", "--version"], capture_output=True, text=True)
    print(f"venv {folder}, toolkit {cuda} ({nvcc.stdout.strip().splitlines()[-1]}), "
          f"set up in {time.monotonic() - started:.1f} s", flush=True)
    results = {}
    for way in ("old", "new"):
        workspace = work / f"ws-{way}"
        shutil.rmtree(workspace, ignore_errors=True)
        workspace.mkdir()
        env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(workspace),
               "FLASHINFER_CUDA_ARCH_LIST": ARCH, "CUDA_HOME": str(cuda), "MAX_JOBS": args.jobs,
               "PATH": f"{folder / 'bin'}:{os.environ['PATH']}"}  # run_ninja calls `ninja`
        done = subprocess.run([folder / "bin/python", "-m", "gpu.prebuild_ninja_check",
                               "--worker", way], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            print(f"prebuild_ninja_check: the {way} way failed:\n{done.stderr[-4000:]}",
                  file=sys.stderr)
            return 1
        results[way] = json.loads(done.stdout.strip().splitlines()[-1])

    old, new = results["old"], results["new"]
    for r in (old, new):
        print(f"\n({r['way']}) {r['jit_dir']}\n  .ninja_log after the prebuild: {r['ninja_logs']}"
              f"\n  ninja -n -d explain in {r['module']}/ (dry run left the folder alone: "
              f"{r['dry_run_left_folder_alone']}):")
        for line in r["explain"]:
            print(f"    {line}")
    rows = [("way", "prebuild", "prebuild s", "ninja -n: would run", "engine s",
             "engine rebuilt", "second prebuild")]
    for r in (old, new):
        rows.append((r["way"], r["prebuild"], str(r["prebuild_s"]), str(r["would_run"]),
                     str(r["engine_s"]), ", ".join(r["engine_rebuilt"]) or "nothing",
                     f"{r['second_prebuild']} ({r['second_prebuild_s']} s)"
                     if "second_prebuild" in r else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    same = old["build_ninja"] == new["build_ninja"]
    print(f"\nbuild.ninja the same both ways (workspace path aside): {same}; "
          f"rewritten by the engine's step: old {old['build_ninja_rewritten']}, "
          f"new {new['build_ninja_rewritten']}")
    ok = (bool(old["engine_rebuilt"]) and old["would_run"] > 0 and not new["engine_rebuilt"]
          and new["would_run"] == 0 and new.get("second_prebuild") == "up to date"
          and old["dry_run_left_folder_alone"] and new["dry_run_left_folder_alone"])
    summary = {k: {f: r[f] for f in ("prebuild_s", "would_run", "engine_s", "engine_rebuilt",
                                     "second_prebuild") if f in r}
               for k, r in results.items()}
    print(json.dumps({"ok": ok, **summary}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
