"""Benchmark (not a test): the controller's CPU for loading the inventory and the deploy, no hosts.

    .venv/bin/python -m bench.load_cpu [--rounds 9] [REV ...]

What a no-op re-run costs the controller before it talks to a host: pyinfra's start, the
inventory (validation, the PKI check) and the deploy's load (every operation call, with pyinfra's
stack walk), measured as `pyinfra -y --dry gpu/inventory.py deploy.py` over the @local connector
(`-y`: no change detection, as in the benchmark's re-runs; `--dry`: nothing executed, no fact
read, this machine untouched). This checkout and each REV (a git worktree of its own, e.g.
1cf33d2 c0aa795) alternate, round by round; prints the median user+sys CPU seconds of pyinfra's
process. The testbed's rtx4090 donor as the one host; its CA in a scratch directory. Needs no
testbed and no lock: for profiling between full runs of bench/noop_rerun.py, which times the
whole re-run on converged hosts.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def donors_file(scratch: Path) -> Path:
    doc = yaml.safe_load((REPO_ROOT / "tests/testbed/donors.yml").read_text())
    overrides = doc["overrides"]
    overrides.update(exllamav3_wheel_cache=str(scratch / "wheel-cache"),
                     pki_dir=str(scratch / "pki"))
    overrides["vllm_exl3_plugin"]["path"] = str(REPO_ROOT / overrides["vllm_exl3_plugin"]["path"])
    donor = dict(doc["donors"]["tb-4090"], ssh_key=str(scratch / "id"),
                 ssh_known_hosts_file=str(scratch / "known_hosts"))
    doc["donors"] = {"tb-4090": donor}
    path = scratch / "donors.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def controller_cpu(cwd: Path, donors: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([str(BIN / "pyinfra"), "-y", "--dry", "gpu/inventory.py", "deploy.py"],
                            cwd=cwd, env={**os.environ, "DONORS_FILE": str(donors)},
                            capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{cwd}: pyinfra failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("revs", nargs="*", help="git revisions to compare with this checkout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="load-cpu-") as tmp:
        scratch = Path(tmp)
        trees = {"this checkout": REPO_ROOT}
        for rev in args.revs:
            tree = scratch / f"rev-{rev}"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO_ROOT,
                           check=True, capture_output=True)
            trees[rev] = tree
        try:
            donors = donors_file(scratch)
            times: dict[str, list[float]] = {label: [] for label in trees}
            for tree in trees.values():
                controller_cpu(tree, donors)  # warm-up: the CA, caches, the page cache
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    times[label].append(controller_cpu(tree, donors))
            for label, values in times.items():
                print(f"{label:16s} controller CPU median {statistics.median(values):.3f} s  "
                      f"min {min(values):.3f}  max {max(values):.3f}  (n={len(values)})")
        finally:
            for rev in args.revs:
                subprocess.run(["git", "worktree", "remove", "--force",
                                str(scratch / f"rev-{rev}")], cwd=REPO_ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
