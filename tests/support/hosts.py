"""Local test hosts: `python -m tests.support.hosts up|down|status` (from the repo root, as root).

Each host is a Debian 12 systemd-nspawn container (real systemd, sshd, apt, pip) in its own network
namespace, on the bridge ucbr0 (10.213.0.1/24) with NAT out to the package mirrors. Stand-ins for
NVIDIA's CUDA repo and for exllamav3's git repo are served from 10.213.0.1:8089. From a test:

    with testbed([("tb-4090", "10.213.0.11")]) as hosts:
        ssh(hosts[0], "systemctl is-system-running")
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass

from donorkit.commands.transport import wait_until

from . import containers, cuda_standin, network, rootfs, www
from .common import REPO_ROOT, WORK, apt_install_missing, log, phase, run

DEFAULT_HOSTS: list[tuple[str, str]] = [("tb-4090", "10.213.0.11"), ("tb-3090", "10.213.0.12")]
STATE = WORK / "state.json"
SSH_DIR = WORK / "ssh"
SSH_KEY = SSH_DIR / "id_ed25519"
KNOWN_HOSTS = WORK / "known_hosts"
READY_TIMEOUT = 180.0
# What each host's stand-in nvidia-smi reports: the card of its entry in tests/testbed/donors.yml
# (rtx4090 for a host not listed there, as the benchmark's), with a driver new enough for it.
DONORS = REPO_ROOT / "tests/testbed/donors.yml"
GOOD_DRIVER = "580.95.05"
# Debian package -> a command it provides; installed only where the command is missing.
TOOLS = {"debootstrap": "debootstrap", "systemd-container": "systemd-nspawn", "nftables": "nft",
         "iproute2": "ip", "dpkg-dev": "dpkg-scanpackages", "apt-utils": "apt-ftparchive",
         "gnupg": "gpg", "git": "git", "openssh-client": "ssh-keyscan", "g++": "g++"}


@dataclass
class Host:
    """A running test host, as a test needs it."""

    name: str
    ip: str
    netns: str
    pid: int | None = None  # the systemd-nspawn process on this machine
    tun: bool = False  # may run WireGuard in user space (containers.boot)
    behind_nat: bool = False  # a home box: no SSH from here, its console only (on_console)


def ssh_command(host: Host | str) -> list[str]:
    """The ssh invocation for a host (root, the run's key, the run's known_hosts, no prompts)."""
    ip = host.ip if isinstance(host, Host) else host
    return ["ssh", "-i", str(SSH_KEY), "-o", f"UserKnownHostsFile={KNOWN_HOSTS}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-o", "ConnectTimeout=5", f"root@{ip}"]


def ssh(host: Host | str, command: str, check: bool = True,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a shell command on a host as root; returns the completed process (text)."""
    return run([*ssh_command(host), command], check=check, quiet=True, timeout=timeout)


def on_console(host: Host, command: str, check: bool = True,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """A shell command as root at the host's own console (its owner at the box): entered with
    nsenter into the container's namespaces, for a home box nothing here can reach."""
    init = containers.init_pid(host.pid)
    return run(["nsenter", "-t", str(init), "-m", "-u", "-i", "-n", "-p", "--",
                "/usr/bin/env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                "/sbin:/bin", "HOME=/root", "LANG=C.UTF-8", "/bin/sh", "-c", command],
               check=check, quiet=True, timeout=timeout)


def standin_gpu(name: str, drivers: dict[str, str] | None = None) -> dict[str, str]:
    """The GPU a host's stand-in nvidia-smi reports (`drivers`: a host's other driver)."""
    from donorkit.inventory.fleet import read_yaml

    defaults = read_yaml(REPO_ROOT / "inventory/defaults.yml")
    donor = (read_yaml(DONORS).get("donors") or {}).get(name) or {}
    card = defaults["cards"][donor.get("card", "rtx4090")]
    # Memory and utilisation (what `make status` reads): a 24 GiB card, a little in use.
    return {"name": card["gpu_name"], "compute_cap": card["arch"],
            "driver_version": (drivers or {}).get(name, GOOD_DRIVER),
            "memory.used": "1234", "memory.total": "24564", "utilization.gpu": "3"}


def up(hosts: Sequence[tuple[str, str]] = DEFAULT_HOSTS,
       times: dict[str, float] | None = None,
       drivers: dict[str, str] | None = None,
       nat: Sequence[str] = (), tun: Sequence[str] = ()) -> list[Host]:
    """Bring the hosts up from scratch (anything left from an earlier run is torn down first).
    `drivers`: {host: driver version} its stand-in nvidia-smi reports instead of a good one.
    `nat`: hosts behind a home router (network.home_net_up; their address in `hosts` is the
    router's); `tun`: hosts that may run WireGuard in user space."""
    times = {} if times is None else times
    _validate(hosts)
    apt_install_missing(TOOLS)  # first: teardown of an earlier run's leftovers may need them
    down()
    with phase("rootfs", times):
        rootfs.ensure_base()
    with phase("repo build", times):
        cuda_standin.build_repo(www.WWW)
        www.build_git_repo(www.WWW)
    with phase("hosts up", times):
        started = _start(hosts, {name: standin_gpu(name, drivers) for name, _ in hosts},
                         set(nat), set(tun))
    for h in started:
        print(f"{h.name}\t{h.ip}")
    return started


def _validate(hosts: Sequence[tuple[str, str]]) -> None:
    """Names become hostnames and namespace names; addresses must be on the testbed's subnet."""
    names, ips = [n for n, _ in hosts], [ip for _, ip in hosts]
    if not hosts or len(set(names)) != len(names) or len(set(ips)) != len(ips):
        raise ValueError(f"hosts must be non-empty with unique names and addresses: {hosts}")
    for name, ip in hosts:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", name):
            raise ValueError(f"host name {name!r}: lowercase letters, digits and '-', max 31")
        if ipaddress.ip_address(ip) not in ipaddress.ip_network(network.SUBNET) or \
                ip.rsplit(".", 1)[1] in ("0", "1", "255"):
            raise ValueError(f"{name}: {ip} is not a host address in {network.SUBNET}")


def _start(hosts: Sequence[tuple[str, str]], gpus: dict[str, dict], nat: set[str] = frozenset(),
           tun: set[str] = frozenset()) -> list[Host]:
    state: dict = {"http_pid": None, "hosts": []}
    network.bridge_up()
    _save(state)  # from here on, whatever exists is recorded before the next step can fail
    network.nat_up()
    state["http_pid"] = www.start_http(www.WWW)
    _save(state)
    pubkey = _new_ssh_key()
    started = []
    for name, ip in hosts:
        host = Host(name, ip, network.netns_name(name), tun=name in tun, behind_nat=name in nat)
        state["hosts"].append(asdict(host))
        _save(state)
        if host.behind_nat:
            _, host.ip = network.home_net_up(name, ip)
        else:
            network.host_net_up(name, ip)
        containers.prepare_root(name, pubkey, gpus[name])
        host.pid = containers.boot(name, host.netns, tun=host.tun).pid
        state["hosts"][-1] = asdict(host)
        _save(state)
        started.append(host)

    def restart(host: Host) -> None:
        """Start a host's nspawn once more (see _keyscan), recorded before it can fail."""
        host.pid = containers.boot(host.name, host.netns, again=True, tun=host.tun).pid
        state["hosts"] = [asdict(h) for h in started]
        _save(state)

    _wait_ready(started, restart)
    return started


def _new_ssh_key() -> str:
    """A fresh root key per run (nothing of an earlier run can log in)."""
    SSH_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    for f in (SSH_KEY, SSH_KEY.with_suffix(".pub")):
        f.unlink(missing_ok=True)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "testbed", "-f", SSH_KEY])
    return SSH_KEY.with_suffix(".pub").read_text()


def _wait_ready(hosts: list[Host], restart) -> None:
    """known_hosts from each sshd once it answers, then systemd must reach running/degraded."""
    deadline = time.monotonic() + READY_TIMEOUT
    # A home box has no known_hosts line here: its owner sends it after joining (make join).
    lines = [_keyscan(h, deadline, restart) for h in hosts if not h.behind_nat]
    KNOWN_HOSTS.write_text("".join(lines))
    for h in hosts:
        left = max(5.0, deadline - time.monotonic())
        if h.behind_nat:
            state = _console_when_booted(h, left)
        else:
            state = ssh(h, "systemctl is-system-running --wait", check=False, timeout=left)
        if state.stdout.strip() not in ("running", "degraded"):
            failed = ssh(h, "systemctl --failed --no-legend", check=False).stdout
            raise RuntimeError(f"{h.name}: systemd is {state.stdout.strip()!r}; failed: {failed}")
        log(f"{h.name} ({h.ip}): systemd {state.stdout.strip()}, sshd answers")


def _console_when_booted(host: Host, timeout: float) -> subprocess.CompletedProcess:
    """`systemctl is-system-running --wait` at a home box's console, once its systemd runs."""
    deadline = time.monotonic() + timeout
    answer: list[subprocess.CompletedProcess] = []

    def answered() -> str | None:
        try:
            answer.append(on_console(host, "systemctl is-system-running --wait", check=False,
                                     timeout=max(5.0, deadline - time.monotonic())))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            return f"{host.name}: its console did not answer within {timeout:.0f} s ({exc})"
        return None

    why = wait_until(answered, timeout, 0.3)
    if why:
        raise RuntimeError(why)
    return answer[0]


def _keyscan(host: Host, deadline: float, restart) -> str:
    """The host's sshd keys once it answers. An nspawn that exits before that (asked of the
    kernel: containers.exited) is started once more, saying so, with its exit status and console
    output in the log line; a second exit fails the run."""
    retried = False
    keys: list[str] = []

    def answered() -> str | None:
        nonlocal retried
        status = containers.exited(host.pid, host.name) if host.pid else None
        if status:
            console = containers.console_log(host.name)
            if retried:
                raise RuntimeError(f"{host.name}: nspawn exited again ({status}); console log "
                                   f"{containers.LOGS / (host.name + '.console.log')}: "
                                   f"{console[-2000:]!r}")
            log(f"{host.name}: nspawn exited right after its start ({status}; console log: "
                f"{console[-500:]!r}): starting it once more")
            restart(host)
            retried = True
        out = run(["ssh-keyscan", "-T", "2", host.ip], check=False, quiet=True).stdout
        if out.strip():
            keys.append(out)
            return None
        return f"{host.name}: sshd did not answer within {READY_TIMEOUT:.0f} s"

    why = wait_until(answered, max(0.0, deadline - time.monotonic()), 0.3)
    if why:
        raise RuntimeError(why)
    return keys[0]


def start_again(host: Host, timeout: float = READY_TIMEOUT) -> None:
    """A host halted by containers.stop booted again from its root as it was (its host keys
    too): back once its sshd answers and systemd is running. The state file records its new
    nspawn, for `down`."""
    host.pid = containers.boot(host.name, host.netns, again=True, tun=host.tun).pid
    state = _load()
    state["hosts"] = [asdict(host) if h.get("name") == host.name else h
                      for h in state.get("hosts", [])]
    _save(state)
    deadline = time.monotonic() + timeout

    def running() -> str | None:
        left = max(5.0, deadline - time.monotonic())
        state = ssh(host, "systemctl is-system-running --wait", check=False, timeout=left)
        if state.stdout.strip() in ("running", "degraded"):
            return None
        return f"{host.name}: not back within {timeout:.0f} s ({state.stdout.strip()!r})"

    why = wait_until(running, timeout, 0.5)
    if why:
        raise RuntimeError(why)
    log(f"{host.name} ({host.ip}): booted again, sshd answers")


def down(times: dict[str, float] | None = None) -> None:
    """Remove everything `up` made; idempotent, and every step runs even when one fails."""
    state = _load()
    errors: list[str] = []
    with phase("teardown", times):
        names = {h["name"]: h.get("pid") for h in state.get("hosts", [])}
        for ns in network.our_netns():
            names.setdefault(ns[len(network.NETNS_PREFIX):], None)
        for name in containers.all_host_dirs():
            names.setdefault(name, None)
        for name, pid in names.items():
            _step(errors, f"stop {name}", containers.stop, name, pid, network.netns_name(name))
        _step(errors, "stop nspawn leftovers", containers.kill_strays)
        _step(errors, "stop http.server", www.stop_http, state.get("http_pid"))
        _step(errors, "network", network.teardown)
        for name in containers.all_host_dirs():
            _step(errors, f"remove {name}", containers.remove_root, name)
        containers.prune_uv_cache()  # no host uses it now
        for f in (STATE, KNOWN_HOSTS, SSH_KEY, SSH_KEY.with_suffix(".pub")):
            f.unlink(missing_ok=True)
    if errors:
        raise RuntimeError("teardown incomplete:\n" + "\n".join(errors))


def _step(errors: list[str], what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001  (teardown goes on; the errors are raised at the end)
        errors.append(f"{what}: {exc}")
        log(f"teardown step failed: {what}: {exc}")


def status() -> list[dict]:
    """What is up now: per host, whether nspawn runs and what systemd says over ssh."""
    state = _load()
    report = []
    for h in state.get("hosts", []):
        alive = bool(h.get("pid")) and containers.is_ours(h["pid"], h["name"])
        said = ssh(h["ip"], "systemctl is-system-running", check=False, timeout=15).stdout.strip()
        report.append({**h, "nspawn_running": alive, "systemd": said or "unreachable"})
    return report


@contextmanager
def testbed(hosts: Sequence[tuple[str, str]] = DEFAULT_HOSTS,
            times: dict[str, float] | None = None,
            drivers: dict[str, str] | None = None,
            nat: Sequence[str] = (), tun: Sequence[str] = ()) -> Iterator[list[Host]]:
    """Hosts up for the block, torn down after it (also on error, Ctrl-C or SIGTERM)."""
    restore = _sigterm_raises()
    try:
        yield up(hosts, times, drivers, nat, tun)
    finally:
        try:
            down(times)
        finally:
            restore()


def _sigterm_raises():
    """Make SIGTERM unwind like Ctrl-C so `finally: down()` runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, old)


def _save(state: dict) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(STATE)


def _load() -> dict:
    with suppress(FileNotFoundError, json.JSONDecodeError):
        return json.loads(STATE.read_text())
    return {}


def _parse_hosts(specs: list[str]) -> list[tuple[str, str]]:
    bad = [s for s in specs if "=" not in s]
    if bad:
        raise ValueError(f"expected NAME=IP, got {bad}")
    return [tuple(s.split("=", 1)) for s in specs] if specs else list(DEFAULT_HOSTS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("hosts", nargs="*", metavar="NAME=IP",
                        help="hosts for `up` (default: tb-4090=10.213.0.11 tb-3090=10.213.0.12)")
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    if args.action == "up":
        hosts = _parse_hosts(args.hosts)
        _validate(hosts)  # a bad argument leaves whatever runs alone
        restore = _sigterm_raises()
        try:
            up(hosts, times)
        except BaseException:
            log("up failed: tearing down")
            down()
            raise
        finally:
            restore()
        log("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    elif args.action == "down":
        down(times)
    else:
        print(json.dumps(status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
