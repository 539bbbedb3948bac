"""One test host = an overlay of the base rootfs booted by systemd-nspawn in its own namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from donorkit.commands.transport import wait_until

from .common import WORK, find_pids, log, remove_tree, run
from .network import netns_pids
from .rootfs import BASE

HOSTS_DIR = WORK / "hosts"
PIP_CACHE = WORK / "pip-cache"
# uv's cache (the venv step installs with uv), kept between runs as pip's is.
UV_CACHE = WORK / "uv-cache"
LOGS = WORK / "logs"


def prune_uv_cache() -> None:
    """Drop what no entry of uv's cache refers to (`uv cache prune`, the controller's own uv:
    the test extra has it). The package mirror here answers without cache validators (no ETag,
    no max-age), so each run's uv fetches the wheels again and unpacks them beside the last
    run's: the cache grew by about 8 GB a run (9.9 -> 18 GB measured). PyPI itself marks its
    files immutable, so a box's own uv cache does not grow so. Never fails the teardown: what
    it could not do is logged."""
    uv = Path(sys.executable).with_name("uv")
    if not UV_CACHE.exists() or not uv.exists():
        return
    result = run([uv, "cache", "prune", "--cache-dir", UV_CACHE], check=False, quiet=True)
    said = (result.stdout + result.stderr).strip().splitlines()
    log(f"uv cache prune: {said[-1] if said else 'no output'} (exit {result.returncode})")


def host_dir(name: str) -> Path:
    return HOSTS_DIR / name


def prepare_root(name: str, pubkey: str, gpu: dict[str, str] | None = None) -> Path:
    """Overlay the base: writes land in the host's upper dir: instant start, clean base.
    `gpu` ({name, compute_cap, driver_version}) is what the stand-in nvidia-smi reports."""
    d = host_dir(name)
    root = d / "root"
    for sub in ("upper", "work", "root"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={BASE},upperdir={d / 'upper'},workdir={d / 'work'}"
    run(["mount", "-t", "overlay", "overlay", "-o", opts, root])
    _personalize(root, name, pubkey)
    if gpu:
        (root / "etc/uncloseai-testbed-gpu").write_text(
            "".join(f"{k}={v}\n" for k, v in gpu.items()))
    return root


def _personalize(root: Path, name: str, pubkey: str) -> None:
    """Identity of one host: hostname, machine id, fresh host keys, the run's root key."""
    (root / "etc/hostname").write_text(f"{name}\n")
    (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n::1 localhost\n")
    (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    run(["ssh-keygen", "-q", "-A", "-f", root])
    ssh = root / "root/.ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    (ssh / "authorized_keys").write_text(pubkey)
    (ssh / "authorized_keys").chmod(0o600)


def boot(name: str, ns: str, again: bool = False, tun: bool = False) -> subprocess.Popen:
    """Start the container detached (own session): `up` from the CLI returns while hosts run on.
    `again`: a second start after the first exited; its console output is appended to the
    first's, which is kept. `tun`: the host may run WireGuard in user space (wireguard-go
    needs /dev/net/tun and CAP_NET_ADMIN; this machine's kernel has no WireGuard module)."""
    PIP_CACHE.mkdir(parents=True, exist_ok=True)
    UV_CACHE.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    # nspawn gives /tmp a small tmpfs; pip holds GBs of torch/CUDA wheels there before installing,
    # as it would on a donor's disk-backed /tmp: give the host a disk-backed /tmp.
    tmp = host_dir(name) / "tmp"
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o1777)
    cmd = ["systemd-nspawn", "--boot", "--register=no", "--keep-unit",
           f"--network-namespace-path=/run/netns/{ns}", f"--machine={name}",
           f"--directory={host_dir(name) / 'root'}", f"--bind={PIP_CACHE}:/root/.cache/pip",
           f"--bind={UV_CACHE}:/root/.cache/uv",
           f"--bind={tmp}:/tmp",
           "--resolv-conf=off", "--link-journal=no", "--console=read-only"]
    if tun:
        cmd += ["--bind=/dev/net/tun", "--capability=CAP_NET_ADMIN"]
    out = open(LOGS / f"{name}.console.log", "ab" if again else "wb")
    # PID 1 of this machine is not systemd: --register=no --keep-unit keep nspawn off machined/dbus.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def init_pid(nspawn_pid: int) -> int:
    """The container's PID 1 (systemd), the nspawn's child."""
    children = Path(f"/proc/{nspawn_pid}/task/{nspawn_pid}/children").read_text().split()
    if not children:
        raise RuntimeError(f"nspawn {nspawn_pid} has no child yet")
    return int(children[0])


def exited(pid: int, name: str) -> str | None:
    """How the nspawn this process started for host `name` ended (reaped here), or None while it
    runs. Asked of the kernel (waitpid), never read from /proc/PID/cmdline: right after Popen
    returns, the child's exec may not have set up its new argument area yet (the kernel closes
    the close-on-exec pipe Popen waits on before it writes the new argv), and cmdline then reads
    empty, so a running nspawn looked gone; starting a second one on the same directory made that
    one exit 1 ("directory busy") while the first went on booting into the shared console log:
    the testbed's `nspawn exited again (exit code 1)` with a log cut mid-boot."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (another process started it): by its cmdline
        return None if is_ours(pid, name) else "exited (not our child: status unknown)"
    if not done:
        return None
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def console_log(name: str) -> str:
    try:
        return (LOGS / f"{name}.console.log").read_text(errors="replace")
    except OSError:
        return ""


def is_ours(pid: int, name: str) -> bool:
    """True if pid is still the nspawn of host `name` (guards against a recycled pid)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return is_nspawn_of([a.decode(errors="replace") for a in raw.split(b"\0")], name)


def is_nspawn_of(argv: list[str], name: str) -> bool:
    return (argv[0].endswith("systemd-nspawn") and f"--machine={name}" in argv
            and f"--directory={host_dir(name) / 'root'}" in argv)


def stop(name: str, pid: int | None, ns: str, timeout: float = 15.0) -> None:
    """Orderly halt (SIGTERM makes nspawn send the container's PID 1 its halt signal), then kill."""
    if not (pid and is_ours(pid, name)):  # state lost: find the host's nspawn by its command line
        found = find_pids(lambda argv: bool(argv[0]) and is_nspawn_of(argv, name))
        pid = found[0] if found else None
    if pid and is_ours(pid, name):
        os.kill(pid, signal.SIGTERM)
        def halted() -> str | None:
            _reap(pid)
            return "running" if is_ours(pid, name) else None

        wait_until(halted, timeout, 0.1)  # then killed, below, if it is still there
    # Whatever still lives in the host's namespace is the container's: kill it, then nspawn.
    leftovers = netns_pids(ns)
    if leftovers:
        log(f"{name}: killing {len(leftovers)} process(es) left in {ns}")
    for p in leftovers:
        _kill(p)
    if pid and is_ours(pid, name):
        log(f"{name}: nspawn {pid} did not exit in {timeout:.0f} s, killing it")
        _kill(pid)
        time.sleep(0.2)
    if pid:
        _reap(pid)


def kill_strays() -> None:
    """nspawns of testbed hosts that no state file names (a crashed run): kill them."""
    prefix = f"--directory={HOSTS_DIR}/"
    for pid in find_pids(lambda argv: argv[0].endswith("systemd-nspawn")
                         and any(a.startswith(prefix) for a in argv)):
        log(f"killing stray nspawn {pid}")
        _kill(pid)
        _reap(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    """Collect the exit of an nspawn this process started (no zombie); ignore others'."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def remove_root(name: str) -> None:
    """Unmount the overlay and delete the host's files (never through a mount)."""
    remove_tree(host_dir(name))


def all_host_dirs() -> list[str]:
    return sorted(p.name for p in HOSTS_DIR.iterdir()) if HOSTS_DIR.is_dir() else []
