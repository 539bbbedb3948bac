"""pyinfra_declared/apt_get.sh in a real shell: apt-get runs only once the lock files are free of
fcntl(2) record locks (what apt and dpkg take), the wait is said on stderr, and it is bounded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from donorkit.inventory.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "pyinfra_declared/apt_get.sh"
HOLD = ("import fcntl, sys, time\n"
        "f = open(sys.argv[1], 'w')\n"
        "fcntl.lockf(f, fcntl.LOCK_EX)\n"  # fcntl F_SETLKW, as apt and dpkg lock
        "print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n")


def hold(lock: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def apt_get(lock: Path, wait: int, *args: str) -> subprocess.CompletedProcess:
    command = f". {SCRIPT}; apt_get_when_free {wait} {' '.join(args)}"
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                               "APT_WAIT_LOCKS": f"{lock} {lock}.absent"})


def test_waits_for_a_held_lock_then_runs_apt_get(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    holder = hold(lock, 3)
    started = time.monotonic()
    result = apt_get(lock, 30, "--version")
    took = time.monotonic() - started
    holder.wait()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("apt "), result.stdout
    assert f"apt is busy ({lock} held by pid {holder.pid}): waiting up to 30 s" in result.stderr
    assert "apt's locks are free after" in result.stderr
    assert took >= 2.0


def test_gives_up_after_the_bound_naming_the_holder(tmp_path: Path) -> None:
    lock = tmp_path / "lists-lock"
    holder = hold(lock, 8)
    try:
        result = apt_get(lock, 1, "--version")
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 1
    assert "apt is still busy after" in result.stderr and f"pid {holder.pid}" in result.stderr
    assert result.stdout == ""  # apt-get never ran


def test_free_locks_run_apt_get_at_once_and_quietly(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    result = apt_get(lock, 30, "--version")
    assert result.returncode == 0 and result.stderr == "", result.stderr
