"""Benchmark (not a test): the deploy's no-op re-run on converged testbed hosts, ours vs stock.

    .venv/bin/python -m bench.noop_rerun [--hosts 4] [--rounds 5] [--baseline REV]
                                         [--modes ours,stock,before,floor]
                                         [--networks loopback,rtt50] [--profile DIR]

Brings up N testbed hosts with the rtx4090 profile (tests/support/hosts.py), converges them with
the real entry point (`pyinfra inventory/gpus.py deploy.py`, DONORS_FILE naming a generated
donors file), then alternates no-op re-runs, at 1 host and at all hosts, of
  (a) ours:   this deploy;
  (b) stock:  the same deploy with the speed-ups off (bench/stock_inventory.py: every fact read
              is its own remote command, pyinfra's stock SSH sockets, no TCP_NODELAY or
              TCP_QUICKACK);
  (c) before: with --baseline REV, the deploy at that git ref as it was, in a git worktree of
              its own: the before and after of a change, timed in one run on the same hosts.
              The ref must read today's testbed donors file (its defaults.yml knows every key:
              an older one stops with the inventory's one line) and converge the hosts the same
              way (a timed run with changes stops the benchmark): e.g. 53d8533, main before
              issue 24's structure work. No default: an old default ref stopped fitting the data;
  (d) floor:  pyinfra connecting to the hosts and reading one fact each, nothing else
              (bench/floor_deploy.py): what no deploy can go below on this machine;
and prints min/median/max wall time, the ratios and remote commands per host (counted from
pyinfra's --debug log). Every timed run must report zero changes, or the benchmark stops.

`--profile DIR` also runs ours once more at 1 host and at all hosts under cProfile (the
controller's process) and prints where its time goes (DIR/noop-1.prof, DIR/noop-N.prof).

Then the same over a 50 ms round trip (`--networks loopback` leaves it out). `tc netem` is what
the issue asks for, but this machine's kernel has no sch_netem ("Specified qdisc kind is
unknown"), so a userspace relay on this machine (bench/latency_relay.py) delays every chunk
25 ms each way between pyinfra and each host's sshd.

On CI-class machines (2 cores) the controller and the test hosts share the CPUs: the all-hosts
figure includes that contention. Each line also gives the median CPU seconds of pyinfra's own
process (controller) and of the rest of the machine during the run (the hosts' sshd and commands,
the relay): on a real fleet the rest runs on the boxes, not next to the controller.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from bench.latency_relay import Relay
from donorkit import __version__
from donorkit.inventory.paths import REPO_ROOT
from tests.support import hosts as bed
from tests.support.deploy import changes, run_deploy

WORK = REPO_ROOT / ".testbed"
TEMPLATE = REPO_ROOT / "tests/testbed/donors.yml"


def donors_file(names: list[tuple[str, str]], path: Path,
                relays: dict[str, tuple[str, int]] | None = None) -> Path:
    """The testbed's donors file with N rtx4090 hosts (through relays when given)."""
    doc = yaml.safe_load(TEMPLATE.read_text())
    # Absolute paths: the baseline worktree must use this checkout's PKI, caches and keys.
    overrides = doc["overrides"]
    for key in ("exllamav3_wheel_cache", "engine_kernel_cache", "pki_dir"):
        overrides[key] = str(REPO_ROOT / overrides[key])
    overrides["vllm_exl3_plugin"]["path"] = str(REPO_ROOT / overrides["vllm_exl3_plugin"]["path"])
    model = doc["donors"]["tb-4090"]
    for key in ("ssh_key", "ssh_known_hosts_file"):
        model[key] = str(REPO_ROOT / model[key])
    doc["donors"] = {}
    # The testbed's edge fronts tb-4090's hostname, which the generated donors do not route (the
    # inventory refuses such an edge): no edge here, only donors are timed.
    doc.pop("edges", None)
    for name, ip in names:
        entry = dict(model, ssh_host=ip, routes={f"{name}.ai.unturf.com": "qwen"})
        if relays:
            entry.update(ssh_host=relays[name][0], ssh_port=relays[name][1],
                         ssh_known_hosts_file=str(WORK / "known_hosts.relayed"))
        doc["donors"][name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no .testbed/ yet
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


MODES = ("ours", "stock", "before", "floor")


def busy_cpu_s() -> float:
    """CPU seconds this machine has spent busy since boot, all cores (/proc/stat)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def deploy(donors: Path, *extra: str, mode: str = "ours", baseline: Path | None = None,
           debug: bool = False, profile: Path | None = None
           ) -> tuple[float, dict, str, dict[str, float]]:
    """One pyinfra run: wall time, its JSON report, its log, and CPU seconds split into the
    controller (pyinfra's process) and the rest of the machine (the hosts' sshd and commands,
    and over 50 ms the relay), which here share the same cores."""
    cwd = REPO_ROOT if mode != "before" else baseline
    inventory = str(REPO_ROOT / "bench/stock_inventory.py") if mode == "stock" else (
        "inventory/gpus.py")
    profiler = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else []
    busy, controller = busy_cpu_s(), children_cpu_s()
    run = run_deploy(*(["--debug"] if debug else []), *extra, inventory=inventory,
                     deploy="bench/floor_deploy.py" if mode == "floor" else "deploy.py",
                     donors=donors, cwd=cwd, timeout=3600, prefix=profiler)
    controller = children_cpu_s() - controller
    cpu = {"controller": controller, "rest": max(busy_cpu_s() - busy - controller, 0.0)}
    if run.rc != 0 or not run.report:
        raise SystemExit(f"deploy failed ({mode}, rc {run.rc}):\n{run.log[-4000:]}")
    return run.elapsed, run.report, run.log, cpu


def commands_per_host(log: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for host in re.findall(r"Running command on (\S+): ", log):
        counts[host] = counts.get(host, 0) + 1
    return counts


def series(donors: Path, extra: list[str], rounds: int, modes: list[str],
           baseline: Path | None) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """Alternate the modes so drift on the machine hits them all alike."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cpus: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            elapsed, report, _, cpu = deploy(donors, *extra, mode=mode, baseline=baseline)
            if changes(report):
                raise SystemExit(f"a no-op re-run changed something ({mode}): {report}")
            times[mode].append(elapsed)
            cpus[mode].append(cpu)
    return times, cpus


def median_cpu(cpus: list[dict], part: str) -> float:
    return statistics.median(cpu[part] for cpu in cpus)


def summary(label: str, times: dict[str, list[float]], counts: dict[str, dict[str, int]],
            cpus: dict[str, list[dict]]) -> None:
    for mode, values in times.items():
        per_host = sorted(set(counts[mode].values()))
        print(f"{label:<28} {mode:<6} min {min(values):6.2f} s  median "
              f"{statistics.median(values):6.2f} s  max {max(values):6.2f} s  "
              f"(n={len(values)}; remote commands per host: {per_host}; median CPU: "
              f"controller {median_cpu(cpus[mode], 'controller'):.2f} s, rest "
              f"{median_cpu(cpus[mode], 'rest'):.2f} s)")
    ours = statistics.median(times["ours"])
    for mode in times:
        if mode != "ours":
            print(f"{label:<28} ratio ours/{mode} (medians): "
                  f"{ours / statistics.median(times[mode]):.2f}")


def measure(donors: Path, names: list[str], rounds: int, label: str, modes: list[str],
            baseline: Path | None) -> dict:
    results = {}
    for scope, extra in (("1 host", ["--limit", names[0]]), (f"{len(names)} hosts", [])):
        counts = {mode: commands_per_host(deploy(donors, *extra, mode=mode, baseline=baseline,
                                                 debug=True)[2]) for mode in modes}
        times, cpus = series(donors, extra, rounds, modes, baseline)
        summary(f"{label}, {scope}", times, counts, cpus)
        results[scope] = {"times": times, "commands": counts, "cpu": cpus}
    for mode in modes:
        one, all_hosts = (statistics.median(results[s]["times"][mode]) for s in results)
        cpu_one, cpu_all = (median_cpu(results[s]["cpu"][mode], "controller") for s in results)
        print(f"{label:<28} {mode}: {len(names)} hosts / 1 host (medians): "
              f"{all_hosts / one:.2f} (controller CPU alone: {cpu_all / cpu_one:.2f})")
    return results


def profile(donors: Path, names: list[str], where: Path) -> None:
    """One no-op run of ours under cProfile at 1 host and at all hosts: the top of the profile."""
    import pstats

    where.mkdir(parents=True, exist_ok=True)
    for scope, extra in (("1", ["--limit", names[0]]), (str(len(names)), [])):
        out = where / f"noop-{scope}.prof"
        elapsed, report, _, _ = deploy(donors, *extra, profile=out)
        print(f"profile, {scope} host(s): {elapsed:.2f} s under cProfile ({changes(report)} "
              f"changes), {out}")
        stats = pstats.Stats(str(out))
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)


def compile_tree(tree: Path) -> None:
    """Byte-compile a tree's Python, as an operator's Python does at its first run (this
    machine's sessions run with PYTHONDONTWRITEBYTECODE=1: without this, every timed run of a
    tree would compile its modules again, and the trees would differ by what they had cached)."""
    folders = [str(tree / name) for name in ("donorkit", "pyinfra_declared", "pyinfra_snapshot",
                                             "tasks", "inventory", "bench")
               if (tree / name).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], check=True,
                   capture_output=True)


def baseline_worktree(rev: str) -> Path:
    """A worktree of `rev`, as it was but for one line: it records our toolkit version. Each
    deploy records its version on the box, so two versions alternating would each change that
    record in every timed run (and the benchmark stops at a change)."""
    path = WORK / "baseline"
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO_ROOT,
                   capture_output=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO_ROOT,
                   check=True, capture_output=True)
    init = path / "donorkit/__init__.py"
    if init.exists():
        init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{__version__}"',
                               init.read_text()))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="",
                        help="git ref of the deploy timed as 'before' (none: (c) is skipped)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma list of the modes to time (ours is always timed)")
    parser.add_argument("--networks", default="loopback,rtt50",
                        help="comma list: loopback, rtt50 (a 50 ms round trip through a relay)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="also profile one no-op run of ours at 1 and at all hosts")
    args = parser.parse_args()
    networks = set(args.networks.split(","))
    names = [("tb-4090", "10.213.0.11")] + [(f"tb-bench{i}", f"10.213.0.{20 + i}")
                                           for i in range(2, args.hosts + 1)]
    wanted = set(args.modes.split(",")) - ({"before"} if not args.baseline else set())
    modes = [mode for mode in MODES if mode == "ours" or mode in wanted]
    baseline = baseline_worktree(args.baseline) if "before" in modes else None
    donors = donors_file(names, WORK / "bench-donors.yml")
    for tree in (REPO_ROOT, baseline):
        if tree:
            compile_tree(tree)
    try:
        with bed.testbed(names) as started:
            # The first host alone, then the others: they find the wheels in the shared uv cache
            # (at once, each host would download and unpack its own copy: ~7.5 GB each).
            first, report, _, _ = deploy(donors, "--limit", names[0][0])
            elapsed, rest, _, _ = deploy(donors)
            print(f"converged {len(started)} hosts in {first + elapsed:.0f} s "
                  f"({changes(report) + changes(rest)} changes)")
            local = slow = None
            if args.profile:
                profile(donors, [n for n, _ in names], args.profile)
            if "loopback" in networks:
                local = measure(donors, [n for n, _ in names], args.rounds, "loopback network",
                                modes, baseline)
            if "rtt50" in networks:
                with Relay({n: (ip, 22) for n, ip in names}, delay_s=0.025) as relay:
                    known = (WORK / "known_hosts").read_text()
                    for name, ip in names:
                        known = known.replace(
                            f"{ip} ", f"[{relay.addresses[name]}]:{relay.ports[name]} ")
                    (WORK / "known_hosts.relayed").write_text(known)
                    through = {n: (relay.addresses[n], relay.ports[n]) for n, _ in names}
                    relayed = donors_file(names, WORK / "bench-donors-relayed.yml", through)
                    slow = measure(relayed, [n for n, _ in names], args.rounds, "50 ms round trip",
                                   modes, baseline)
    finally:
        if baseline:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)],
                           cwd=REPO_ROOT, capture_output=True)
    (WORK / "bench-noop.json").write_text(json.dumps({"loopback": local, "rtt50": slow},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
