"""Benchmark (not a test): a cold deploy, fresh testbed box to converged, per phase; the same
packages installed by hand on an identical fresh box; pip (the deploy before uv) against uv, in
one run; and 1, 2 and 4 fresh boxes of one stack at once.

    flock /tmp/uncloseai-testbed.lock .venv/bin/python -m bench.cold_deploy \
        [--sizes 1,2,4] [--baseline REV] [--skip hand-pip,before,...]

Runs, in this order, each on fresh testbed hosts (tests/support/hosts.py; torn down after each
group, so at most four venvs of ~7.5 GB are on disk at a time), rtx4090 profile (real vllm
0.26.0 and torch 2.11.0 from PyPI, the stand-in CUDA 13.3 repository, the stand-in exllamav3,
the stand-in hub and vLLM: tests/testbed/README.md):
  after-N    this deploy (uv), N fresh boxes at once, for each N of --sizes; with after-1 a
             second fresh box installed by hand with uv (hand-uv, warm uv cache): by hand, the
             way the README's packages would be put on a box without the toolkit: apt (NVIDIA's
             network-repository steps: keyring package, sources line, the toolkit and the build
             tools), then the venv (pip installs uv into it, uv the rest), then the exllamav3
             wheel (copied from the wheel cache with scp, pip install --no-deps).
  before     (after after-1) the deploy at --baseline (default 5a63750: main before issue 22,
             its venv with pip), unpacked with `git archive`, one fresh box: pip vs uv.
  hand-pip   by hand as hand-uv, the venv with pip (the testbed's shared pip cache).
  hand-uv-cold  by hand with uv and an EMPTY uv cache of its own: the cold-cache uv figure.
The wheel cache is seeded from the testbed's (.testbed/wheel-cache), so the exllamav3 phase is a
fetch (upload + verify + install), as for every box after a stack's first.

Phases come from pyinfra's own log, timestamped here as it streams: the time from one task
file's first operation to the next task file's ("connect + plan" before the first operation).
Operations run one at a time over all hosts, so a phase of an N-box run is the wall time of
that phase for the whole batch. The by-hand script stamps its own steps on the box.

On CI-class machines (2 cores) the controller, the boxes and their unpacking share the CPUs and
the disk: N boxes at once contend for both, as the figures show.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import yaml

from bench.noop_rerun import donors_file
from donorkit.inventory.fleet import DEFAULTS_FILE, read_yaml
from donorkit.inventory.paths import REPO_ROOT
from tests.support.deploy import run_deploy

BIN = Path(sys.executable).parent
WORK = REPO_ROOT / ".testbed"
BASELINE = "5a63750"  # main before issue 22: the venv installed with pip
# A step's name in the run log -> phase, in deploy order (deploy.py): its deploy name (tasks/
# modules are pyinfra deploys), or its task file as the deploy before them named it (a --baseline
# revision).
PHASES = {
    "Preflight": "preflight", "preflight.py": "preflight",
    "CUDA toolkit": "CUDA packages", "cuda.py": "CUDA packages",
    "Build tools": "build tools", "build_tools.py": "build tools",
    "Service user": "service user", "service_user.py": "service user",
    "vLLM venv": "venv", "vllm_venv.py": "venv",
    "exllamav3": "exllamav3 wheel fetch", "exllamav3.py": "exllamav3 wheel fetch",
    "vllm-exl3 plugin": "plugin", "plugin.py": "plugin",
    "Weights": "weights", "weights.py": "weights",
    "vLLM units": "units: start to ready", "units.py": "units: start to ready",
    "Caddy repository": "Caddy", "caddy_repository.py": "Caddy",
    "GPU-side Caddy": "Caddy", "caddy.py": "Caddy",
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTING = re.compile(r"--> Starting (?:[\w ,]+ )?operation: (?:tasks/)?(.+?) \| ")


def phases_of(lines: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Seconds per phase from (timestamp, line) pairs of a pyinfra run that started at 0."""
    found: dict[str, float] = {}
    current, since = "connect + plan", 0.0
    for stamp, line in lines:
        match = STARTING.search(ANSI.sub("", line))
        if not match:
            continue
        phase = PHASES.get(match[1], match[1])
        if phase != current:
            found[current] = found.get(current, 0.0) + stamp - since
            current, since = phase, stamp
    found[current] = found.get(current, 0.0) + end - since
    return found


def deploy(donors: Path, cwd: Path = REPO_ROOT) -> tuple[float, dict[str, float], str]:
    """One pyinfra run, its log streamed and timestamped: (wall s, phases, log)."""
    lines: list[tuple[float, str]] = []
    run = run_deploy(donors=donors, cwd=cwd, json_report=False, lines=lines, timeout=7200)
    if run.rc != 0:
        raise SystemExit(f"deploy failed (rc {run.rc}, {cwd}):\n{run.log[-4000:]}")
    return run.elapsed, phases_of(lines, run.elapsed), run.log


STAMP = 'step() { echo "@@step $1 $(date +%s.%N)"; }'


def hand_script(installer: str, wheel: str, uv_cache: str | None = None) -> tuple[str, str]:
    """What an operator would type on a fresh box for the same packages, with a stamp before
    each step (`@@step NAME SECONDS`): (apt and the venv; the wheel's install). `wheel`: the
    exllamav3 wheel's path on the box (copied there between the two)."""
    d = read_yaml(DEFAULTS_FILE)
    repo = read_yaml(REPO_ROOT / "tests/testbed/donors.yml")["overrides"]["cuda_repo_url"]
    repo = repo.rstrip("/")
    cuda = d["cards"]["rtx4090"]["cuda"]
    keyring = d["cuda_keyring_path"]
    packages = [f"vllm=={d['vllm_version']}", f"torch=={d['torch_version']}",
                *d["venv_build_packages"]]
    venv, q = "/opt/hand/venv", shlex.quote
    apt = "DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=600"
    if installer == "pip":
        install = f"{venv}/bin/pip install -q {' '.join(map(q, packages))}"
    else:
        cache = f"--cache-dir {q(uv_cache)} " if uv_cache else ""
        install = (f"{venv}/bin/pip install -q uv=={q(d['uv_version'])} && {venv}/bin/uv pip "
                   f"install --python {venv}/bin/python -q --system-certs {cache}"
                   f"{' '.join(map(q, packages))}")
    packages_part = "\n".join([
        "set -e", STAMP,
        "step apt",
        f"{apt} update >/dev/null",
        f"{apt} install curl ca-certificates >/dev/null",
        f"curl -fsSL -o /tmp/keyring.deb {q(repo + '/' + d['cuda_keyring_deb'])}",
        "dpkg -i /tmp/keyring.deb >/dev/null",
        f"echo {q(f'deb [signed-by={keyring}] {repo}/ /')} > /etc/apt/sources.list.d/cuda.list",
        f"{apt} update >/dev/null",
        f"{apt} install cuda-toolkit-{cuda.replace('.', '-')} "
        f"{' '.join(map(q, d['build_packages']))} >/dev/null",
        "step venv",
        f"python3 -m venv {venv}",
        install,
        "step done", ""])
    wheel_part = "\n".join([
        "set -e", STAMP,
        "step wheel",
        f"{venv}/bin/pip install -q --no-deps {q(wheel)}",
        "step done", ""])
    return packages_part, wheel_part


def stamped_steps(output: str) -> dict[str, float]:
    stamps = [(m[1], float(m[2])) for m in re.finditer(r"@@step (\S+) ([0-9.]+)", output)]
    return {name: stamps[i + 1][1] - stamp for i, (name, stamp) in enumerate(stamps[:-1])
            if name != "done"}


def hand(host, installer: str, cached_wheel: Path, uv_cache: str | None = None) -> dict:
    """The by-hand install on a fresh box: seconds per step (the wheel's scp counted in)."""
    from tests.support.hosts import KNOWN_HOSTS, SSH_KEY, ssh

    remote_wheel = f"/tmp/{cached_wheel.name}"
    packages_part, wheel_part = hand_script(installer, remote_wheel, uv_cache)
    started = time.monotonic()
    steps = stamped_steps(ssh(host, f"sh -c {shlex.quote(packages_part)}", timeout=3600).stdout)
    copy_started = time.monotonic()
    subprocess.run(["scp", "-q", "-i", str(SSH_KEY), "-o", f"UserKnownHostsFile={KNOWN_HOSTS}",
                    "-o", "BatchMode=yes", str(cached_wheel), f"root@{host.ip}:{remote_wheel}"],
                   check=True)
    copy = time.monotonic() - copy_started
    wheel = stamped_steps(ssh(host, f"sh -c {shlex.quote(wheel_part)}", timeout=600).stdout)
    steps["wheel"] = wheel["wheel"] + copy
    return {"total": time.monotonic() - started, "steps": steps}


def export_tree(rev: str, dest: Path) -> Path:
    """The deploy at `rev`, as files (git archive: no worktree, no change to the repository)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def seed_cache(cache: Path) -> Path:
    """The bench's wheel cache, seeded from the testbed's; returns the cached wheel."""
    shutil.rmtree(cache, ignore_errors=True)
    source = WORK / "wheel-cache"
    if source.is_dir():
        shutil.copytree(source, cache)
    wheels = sorted(cache.rglob("exllamav3-*.whl"))
    if not wheels:
        raise SystemExit(f"no exllamav3 wheel in {source}: run `make testbed` first")
    # Only a cache builder's entries are shipped (issue 32) and tb-4090, which built this one,
    # is not in the bench's inventories: the bench, as the operator, vouches for it as built by
    # tb-cold1, a cache builder of every run (its entries copy tb-4090's).
    for built_by in cache.rglob("built-by"):
        built_by.write_text("tb-cold1\n")
    return wheels[0]


def bench_donors(names: list[tuple[str, str]], path: Path, cache: Path,
                 baseline: bool = False) -> Path:
    """The testbed's donors file with these rtx4090 boxes, using the bench's wheel cache
    (`baseline`: for a deploy from before cache builders, whose inventory has no such key)."""
    donors_file(names, path)
    doc = yaml.safe_load(path.read_text())
    doc["overrides"]["exllamav3_wheel_cache"] = str(cache)
    doc["overrides"]["engine_kernel_cache"] = f"{cache}-kernels"
    if baseline:
        for entry in doc["donors"].values():
            entry.pop("cache_builder", None)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def show(label: str, total: float, parts: dict[str, float]) -> None:
    detail = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
    print(f"{label:<24} total {total:7.1f} s   ({detail})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--skip", default="", help="comma list of runs to leave out: "
                        "after-N, hand-uv, before, hand-pip, hand-uv-cold")
    args = parser.parse_args()
    from tests.support import hosts as bed

    skip = set(filter(None, args.skip.split(",")))
    sizes = [int(n) for n in args.sizes.split(",")]
    cache = WORK / "bench-wheel-cache"
    wheel = seed_cache(cache)
    results: dict[str, dict] = {}
    out = WORK / "bench-cold.json"

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    # The most wanted figures first: results are saved after each run (a run cut short keeps
    # what it measured).
    for n in sizes:
        if f"after-{n}" in skip:
            continue
        names = [(f"tb-cold{i}", f"10.213.0.{60 + i}") for i in range(1, n + 1)]
        donors = bench_donors(names, WORK / f"bench-cold-{n}.yml", cache)
        extra = [("tb-hand-uv", "10.213.0.59")] if n == 1 and "hand-uv" not in skip else []
        with bed.testbed(names + extra) as hs:
            elapsed, phases, _ = deploy(donors)
            results[f"after-{n}"] = {"total": elapsed, "phases": phases}
            show(f"deploy (uv), {n} at once", elapsed, phases)
            save()
            if extra:
                results["hand-uv"] = hand(hs[-1], "uv", wheel)
                show("by hand, uv, warm cache", results["hand-uv"]["total"],
                     results["hand-uv"]["steps"])
                save()
        if n == 1 and "before" not in skip:
            tree = export_tree(args.baseline, WORK / "bench-before")
            names = [("tb-before", "10.213.0.53")]
            donors = bench_donors(names, WORK / "bench-cold-before.yml", cache, baseline=True)
            with bed.testbed(names):
                elapsed, phases, _ = deploy(donors, cwd=tree)
            results["before-1"] = {"total": elapsed, "phases": phases, "rev": args.baseline}
            show(f"deploy {args.baseline} (pip), 1", elapsed, phases)
            save()
    hand_runs = [r for r in ("hand-pip", "hand-uv-cold") if r not in skip]
    if hand_runs:
        with bed.testbed([("tb-hand-pip", "10.213.0.51"), ("tb-hand-uv", "10.213.0.52")]) as hs:
            if "hand-pip" in hand_runs:
                results["hand-pip"] = hand(hs[0], "pip", wheel)
                show("by hand, pip", results["hand-pip"]["total"], results["hand-pip"]["steps"])
                save()
            if "hand-uv-cold" in hand_runs:
                results["hand-uv-cold"] = hand(hs[1], "uv", wheel, uv_cache="/tmp/uv-empty")
                show("by hand, uv, cold cache", results["hand-uv-cold"]["total"],
                     results["hand-uv-cold"]["steps"])
                save()
    summary(results)
    return 0


def summary(results: dict) -> None:
    """The toolkit's share and the before/after, from what was measured."""
    if "after-1" in results and "hand-uv" in results:
        deploy_ = results["after-1"]["phases"]
        same = {"apt": deploy_.get("CUDA packages", 0) + deploy_.get("build tools", 0),
                "venv": deploy_.get("venv", 0), "wheel": deploy_.get("exllamav3 wheel fetch", 0)}
        by_hand = results["hand-uv"]["steps"]
        for step in same:
            print(f"same packages, {step:<6} deploy {same[step]:6.1f} s  by hand "
                  f"{by_hand.get(step, 0):6.1f} s")
        ours = sum(same.values()) - sum(by_hand.values())
        rest = results["after-1"]["total"] - sum(same.values())
        print(f"toolkit's share of a cold deploy: {ours:+.1f} s on the same packages, plus "
              f"{rest:.1f} s for what the hand install does not do (preflight, user, plugin, "
              f"weights, units to ready, Caddy, connect + plan) of "
              f"{results['after-1']['total']:.1f} s")
    if "before-1" in results and "after-1" in results:
        print(f"venv phase, pip (before) {results['before-1']['phases'].get('venv', 0):.1f} s, "
              f"uv (after) {results['after-1']['phases'].get('venv', 0):.1f} s; whole deploy "
              f"{results['before-1']['total']:.1f} s -> {results['after-1']['total']:.1f} s")
    for key in sorted(k for k in results if k.startswith("after-")):
        n = int(key.split("-")[1])
        print(f"{n} box(es) at once: {results[key]['total']:.1f} s, "
              f"{results[key]['total'] / n:.1f} s per box")


if __name__ == "__main__":
    sys.exit(main())
