"""Benchmark (not a test): the controller's CPU for loading the inventory and the deploy, no hosts.

    .venv/bin/python -m bench.load_cpu [--rounds 9] [REV ...]

What a no-op re-run costs the controller before it talks to a host: pyinfra's start, the
inventory (validation, the PKI check) and the deploy's load (every operation call, with pyinfra's
stack walk), measured as `pyinfra -y --dry <inventory> deploy.py` over the @local connector
(`-y`: no change detection, as in the benchmark's re-runs; `--dry`: nothing executed, no fact
read, this machine untouched). The inventory is gpu/inventory.py's loader with its donor in the
group `donors` (deploy.py builds only that group since issue 15). This checkout and each REV (a
git worktree of its own, e.g. 1cf33d2 c0aa795) alternate, round by round; prints the median
user+sys CPU seconds of pyinfra's process. The testbed's rtx4090 donor as the one host, from each
tree's own testbed donors file; its CA in a scratch directory. Needs no testbed and no lock: for
profiling between full runs of bench/noop_rerun.py, which times the
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

from donorkit.inventory.paths import REPO_ROOT

BIN = Path(sys.executable).parent


def donors_file(tree: Path, scratch: Path) -> Path:
    """The testbed's tb-4090 as the one donor, from `tree`'s own testbed donors file (what that
    revision's schema accepts: an edge, say, is refused before issue 15), in its own scratch."""
    scratch.mkdir(parents=True, exist_ok=True)
    doc = yaml.safe_load((tree / "tests/testbed/donors.yml").read_text())
    doc.pop("edges", None)  # the load of a donor's deploy is measured, not an edge's
    overrides = doc["overrides"]
    overrides.update(exllamav3_wheel_cache=str(scratch / "wheel-cache"),
                     engine_kernel_cache=str(scratch / "kernel-cache"),
                     pki_dir=str(scratch / "pki"))
    overrides["vllm_exl3_plugin"]["path"] = str(tree / overrides["vllm_exl3_plugin"]["path"])
    donor = dict(doc["donors"]["tb-4090"], ssh_key=str(scratch / "id"),
                 ssh_known_hosts_file=str(scratch / "known_hosts"))
    doc["donors"] = {"tb-4090": donor}
    path = scratch / "donors.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    local_inventory(tree, scratch)
    return path


def local_inventory(tree: Path, scratch: Path) -> Path:
    """gpu/inventory.py's @local donor, as the group `donors` (gpu/inventory.py names it `device`
    for gpu/deploy.py; deploy.py builds a donor only in `donors`). Fails loudly, not silently
    measuring an empty deploy, if the tree's loader has another shape."""
    text = (tree / "gpu/inventory.py").read_text()
    if "\ndevice = " not in text:
        raise SystemExit(f"{tree}/gpu/inventory.py: no `device = ` group to rename")
    path = scratch / "inventory.py"
    path.write_text(text.replace("Path(__file__).resolve().parent.parent", f"Path({str(tree)!r})")
                    .replace("\ndevice = ", "\ndonors = "))
    return path


def controller_cpu(cwd: Path, donors: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    inventory = donors.parent / "inventory.py"
    result = subprocess.run([str(BIN / "pyinfra"), "-y", "--dry", str(inventory), "deploy.py"],
                            cwd=cwd, env={**os.environ, "DONORS_FILE": str(donors)},
                            capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{cwd}: pyinfra failed:\n{(result.stdout + result.stderr)[-3000:]}")
    output = result.stdout + result.stderr
    if "Ready: deploy.py" not in output:
        raise SystemExit(f"{cwd}: deploy.py was not loaded:\n{output[-3000:]}")
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
            donors = {label: donors_file(tree, scratch / f"data-{n}")
                      for n, (label, tree) in enumerate(trees.items())}
            times: dict[str, list[float]] = {label: [] for label in trees}
            for label, tree in trees.items():
                controller_cpu(tree, donors[label])  # warm-up: the CA, caches, the page cache
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    times[label].append(controller_cpu(tree, donors[label]))
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
