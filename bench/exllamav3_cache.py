"""Benchmark (not a test): exllamav3 cold build vs. wheel-cache hit, with the deploy's own code.

Runs `pyinfra -y INVENTORY DEPLOY` three times against boxes whose processes are visible here
(@local, or containers on this machine such as the testbed's):
  1. cold:     cache entry and box wiped -> the box builds the wheel, installs it, copies it back
  2. warm:     box wiped, cache kept     -> cache hit: upload + verify + install, no compiler
  3. converge: nothing wiped             -> no change expected
  4. corrupt:  box wiped, cached wheel's last byte flipped -> refused, naming the file
  5. warm2:    byte restored             -> cache hit again (leaves the box installed)
and prints cold build time, warm time, their ratio, the build's peak memory (MemTotal -
MemAvailable above the idle level before it, sampled every 0.25 s) and any compiler process seen
during the warm run (/proc scanned every 0.05 s, the deploy's descendants only unless
--any-process; a cache hit must show none).

    python3 bench/exllamav3_cache.py --inventory gpu/inventory.py --deploy gpu/deploy.py \
        --wipe-box "sh gpu/wipe_box.sh" [--after-cold CMD] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from donorkit.inventory.paths import REPO_ROOT

# What any compile of the extension runs. Not nvcc itself: the stack fact runs `nvcc --version`
# on every deploy, and every real nvcc compile runs cicc/ptxas and the host compiler's cc1plus.
COMPILERS = {"cicc", "ptxas", "cc1plus", "cc1", "ninja", "fatbinary", "nvlink"}


def meminfo_used_kib() -> int:
    fields = {}
    with open("/proc/meminfo") as stream:
        for line in stream:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    return fields["MemTotal"] - fields["MemAvailable"]


class Sampler(threading.Thread):
    """Peak memory in use and compiler processes seen, while a step runs."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.stop = threading.Event()
        self.idle_kib = meminfo_used_kib()
        self.peak_kib = self.idle_kib
        self.compilers: set[str] = set()
        self.root_pid: int | None = None  # count only this process's descendants, when set

    def descends(self, pid: str) -> bool:
        if self.root_pid is None:
            return True
        for _ in range(64):
            if int(pid) == self.root_pid:
                return True
            try:
                with open(f"/proc/{pid}/stat") as stream:
                    pid = stream.read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                return False
            if pid in ("0", "1"):
                return False
        return False

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_kib = max(self.peak_kib, meminfo_used_kib())
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        with open(f"/proc/{entry.name}/comm") as stream:
                            name = stream.read().strip()
                    except OSError:
                        continue
                    if name in COMPILERS and self.descends(entry.name):
                        self.compilers.add(name)
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()


def deploy(args: argparse.Namespace, step: str, interval: float) -> dict:
    """One pyinfra run; its output is appended to OUT/bench.log under a `=== step` header."""
    log = Path(args.out) / "bench.log"
    command = [sys.executable, "-m", "pyinfra", "-y", args.inventory, args.deploy]
    with Sampler(interval) as sampler:
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO_ROOT)
        if not args.any_process:
            sampler.root_pid = proc.pid
        stdout = proc.communicate()[0]
        seconds = time.monotonic() - start
    run = subprocess.CompletedProcess(command, proc.returncode, stdout)
    with log.open("a") as stream:
        stream.write(f"=== {step} (rc {run.returncode}, {seconds:.1f} s)\n{run.stdout}\n")
    result = {"step": step, "rc": run.returncode, "seconds": round(seconds, 1),
              "peak_mem_gib": round((sampler.peak_kib - sampler.idle_kib) / 2**20, 2),
              "compilers_seen": sorted(sampler.compilers),
              "ops_changed": changed_ops(run.stdout), "log": run.stdout}
    print(f"{step}: rc={run.returncode} {result['seconds']} s, peak +{result['peak_mem_gib']} "
          f"GiB, compiler processes: {', '.join(result['compilers_seen']) or 'none'}",
          flush=True)
    if run.returncode != 0 and step != "corrupt":
        print(run.stdout[-4000:], file=sys.stderr)
    return result


def changed_ops(log: str) -> int | None:
    """The Success column of pyinfra's "Grand total" row: operations that changed something."""
    for line in log.splitlines():
        if line.strip().startswith("Grand total"):
            success = line.split()[3]
            return 0 if success == "-" else int(success)
    return None


def corrupt_byte(path: Path) -> bytes:
    """Flip the last byte of `path`; return the original byte."""
    with path.open("r+b") as stream:
        stream.seek(-1, os.SEEK_END)
        original = stream.read(1)
        stream.seek(-1, os.SEEK_END)
        stream.write(bytes([original[0] ^ 0xFF]))
    return original


def restore_byte(path: Path, original: bytes) -> None:
    with path.open("r+b") as stream:
        stream.seek(-1, os.SEEK_END)
        stream.write(original)


def sh(command: str) -> None:
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=True, cwd=REPO_ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inventory", required=True)
    parser.add_argument("--deploy", required=True)
    parser.add_argument("--wipe-box", required=True, help="shell command that wipes the box(es)")
    parser.add_argument("--cache", default=".wheel-cache", help="the wheel cache (wiped first)")
    parser.add_argument("--after-cold", help="shell command run after the cold deploy")
    parser.add_argument("--any-process", action="store_true",
                        help="count compilers of every process (boxes in containers here), "
                             "not only the deploy's own descendants (@local)")
    parser.add_argument("--out", default="out/bench", help="bench.log and summary.json")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench.log").unlink(missing_ok=True)

    cache = REPO_ROOT / args.cache / "exllamav3"
    shutil.rmtree(cache, ignore_errors=True)
    sh(args.wipe_box)
    cold = deploy(args, "cold", 0.25)
    if cold["rc"] != 0:
        return 1
    if args.after_cold:
        sh(args.after_cold)
    sh(args.wipe_box)
    warm = deploy(args, "warm", 0.05)
    converge = deploy(args, "converge", 0.25)

    # A corrupt cached wheel is refused before anything reaches the box.
    wheels = sorted(cache.glob("*/*.whl"))
    sh(args.wipe_box)
    original = corrupt_byte(wheels[0]) if wheels else b""
    try:
        corrupt = deploy(args, "corrupt", 0.25)
    finally:
        if wheels:
            restore_byte(wheels[0], original)
    refused = (corrupt["rc"] != 0 and bool(wheels)
               and f"cached wheel {wheels[0]} is corrupt" in corrupt["log"])
    # Leave the box installed (from the cache again: a second warm sample).
    warm2 = deploy(args, "warm2", 0.05)

    steps = (cold, warm, converge, corrupt, warm2)
    summary = {
        "cold_build_s": cold["seconds"], "warm_cache_hit_s": warm["seconds"],
        "warm2_cache_hit_s": warm2["seconds"],
        "ratio": round(cold["seconds"] / warm["seconds"], 1) if warm["seconds"] else None,
        "cold_peak_mem_gib": cold["peak_mem_gib"],
        "cold_compilers_seen": cold["compilers_seen"],
        "warm_compilers_seen": sorted(set(warm["compilers_seen"]) | set(warm2["compilers_seen"])),
        "ops_changed": {r["step"]: r["ops_changed"] for r in steps},
        "rc": {r["step"]: r["rc"] for r in steps},
        "corrupt_wheel_refused": refused,
        "cache": sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()),
    }
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    ok = (warm["rc"] == 0 and converge["rc"] == 0 and warm2["rc"] == 0 and refused
          and not summary["warm_compilers_seen"] and converge["ops_changed"] == 0)
    print(f"cold build {cold['seconds']} s, cache hit {warm['seconds']} s, "
          f"ratio {summary['ratio']}x, peak build memory +{cold['peak_mem_gib']} GiB; "
          f"{'OK' if ok else 'FAILED'} ({shlex.quote(args.inventory)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
