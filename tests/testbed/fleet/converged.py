"""The fleet converged once for every scenario (conftest.py's fixture): the hosts deployed through
the real entry point in the order a new fleet meets, with a record of what each step took for
the scenarios that assert on it (test_converge.py)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field

from donorkit.inventory.paths import REPO_ROOT
from tests.support.deploy import Deployed, run_deploy
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.helpers import (
    BAD,
    BIN,
    DONORS,
    EDGE,
    GOOD,
    SECOND,
    TIMES,
    deploy,
    pyinfra_as_a_user_runs_it,
)

# Holds apt's lists lock and dpkg's frontend lock the way apt does (fcntl record locks), as
# apt-daily and unattended-upgrades do on a box that just booted.
LOCK_HOLDER = ("import fcntl, time\n"
               "held = [open(p, 'a') for p in ('/var/lib/apt/lists/lock', "
               "'/var/lib/dpkg/lock-frontend')]\n"
               "for f in held: fcntl.lockf(f, fcntl.LOCK_EX)\n"
               "open('/run/uncloseai-locks-held', 'w').close()\n"
               "time.sleep({seconds})\n")


@dataclass
class Record:
    """What converging the fleet took, in the order it happened. A step that could not be done
    as planned is recorded as such (the converge scenario's tests fail on it); the fixture goes
    on, so the other scenarios still run."""

    # tb-edge deployed first with a rate limit its Caddy cannot honour: the run and the box after
    # it (`command -v caddy`'s status, the Caddyfile, `test -e /etc/caddy/tls`'s status).
    rate_limited: subprocess.CompletedProcess | None = None
    edge_after_refusal: dict[str, object] = field(default_factory=dict)
    # The first run on tb-4090 killed in its venv step: was it still running then.
    interrupted_in_venv_step: bool = False
    # The full run (all but tb-4090b; tb-3090's apt locks held for its first 30 s).
    first: Deployed | None = None
    # tb-4090b, a second box of tb-4090's stack: its bare `--dry` preview, dpkg killed
    # mid-install, its deploy, and what it holds after.
    second_wheels_before: list = field(default_factory=list)
    second_dry: tuple[int, str] = (0, "")
    second_bare: int = 0  # `test -e /opt/uncloseai`'s status before its deploy
    dpkg_killed: str = ""
    dpkg_audit_killed: str = ""
    second: Deployed | None = None
    second_after: dict[str, object] = field(default_factory=dict)


@dataclass
class Fleet:
    hosts: dict[str, Host]
    record: Record


def rate_limited_edge(record: Record, edge: Host) -> None:
    """The testbed's donors file has `rate_limit: null`; this run uses a copy with the seed's
    limit, through the fleet inventory's DONORS_FILE."""
    doc = DONORS.read_text().replace("    rate_limit: null\n",
                                     "    rate_limit: {events: 3, window: 1s, key: "
                                     "\"{remote_host}\"}\n")
    limited = REPO_ROOT / ".testbed/donors-rate-limited.yml"
    limited.write_text(doc)
    rc, _, output, _ = run_deploy("--limit", EDGE, donors=limited, json_report=False,
                                  timeout=900)
    record.rate_limited = subprocess.CompletedProcess([], rc, output, "")
    record.edge_after_refusal = {
        "caddy": ssh(edge, "command -v caddy", check=False).returncode,
        "caddyfile": ssh(edge, "cat /etc/caddy/Caddyfile", check=False).stdout,
        "tls": ssh(edge, "test -e /etc/caddy/tls", check=False).returncode,
        "limited_file": doc}


def interrupted_then_full_run(record: Record, hosts: dict[str, Host]) -> None:
    """Kill the deploy while tb-4090's venv is being installed; then the full run."""
    good = hosts[GOOD]
    started = time.monotonic()
    proc = subprocess.Popen([str(BIN / "pyinfra"), "-y", "inventory/testbed.py", "deploy.py",
                             "--limit", GOOD], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while proc.poll() is None and time.monotonic() - started < 1500:
            if ssh(good, "pgrep -f '[v]llm-venv/bin/uv pip install'", check=False).returncode == 0:
                time.sleep(5)  # into the download/unpack of vllm and torch (uv is quick)
                break
            time.sleep(1)
        record.interrupted_in_venv_step = proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The controller died; its remote uv would be left running by sshd: end it as a crash would.
    ssh(good, "pkill -9 -f '[v]llm-venv/bin/uv' || true")
    TIMES["interrupted run"] = time.monotonic() - started

    # A first-boot box: tb-3090's apt locks are held for 30 s as the deploy starts. Its apt
    # steps wait (said on stderr: -vvv prints it) and go on; tb-4090 runs meanwhile.
    bad = hosts[BAD]
    ssh(bad, "rm -f /run/uncloseai-locks-held; nohup setsid python3 -c "
             f"{shlex.quote(LOCK_HOLDER.format(seconds=30))} </dev/null >/dev/null 2>&1 &")
    ssh(bad, "for i in $(seq 50); do test -e /run/uncloseai-locks-held && exit 0; sleep 0.1; "
             "done; exit 1")
    record.first = deploy("--exclude", SECOND, "-vvv", want_json=False)
    TIMES["first converge"] = record.first.elapsed


def second_box_from_the_cache(record: Record, hosts: dict[str, Host]) -> None:
    """tb-4090b, bare, previewed with `--dry`; its dpkg killed mid-install (as an SSH drop
    would), at the worst moment: while a package is unpacked over its installed version, so dpkg
    marks it "reinstall required" (build-essential upgrades perl-base first on this rootfs);
    then its deploy, from the wheel tb-4090 built."""
    second = hosts[SECOND]
    record.second_wheels_before = sorted(
        (REPO_ROOT / ".testbed/wheel-cache").rglob("exllamav3-*.whl"))
    record.second_dry = pyinfra_as_a_user_runs_it("inventory/testbed.py", "deploy.py",
                                                  "--limit", SECOND, "--dry")
    record.second_bare = ssh(second, "test -e /opt/uncloseai", check=False).returncode
    started = time.monotonic()
    ssh(second, "apt-get -q update >/dev/null")
    record.dpkg_killed = ssh(
        second, "nohup setsid apt-get -q -y install build-essential </dev/null "
                ">/tmp/apt.log 2>&1 & "
                "for i in $(seq 6000); do "
                "if dpkg-query -W -f='${db:Status-Abbrev}\\n' 2>/dev/null "
                "| grep -q '^..R'; then "
                "pkill -KILL -x dpkg; pkill -KILL -x apt-get; echo killed; exit 0; "
                "fi; sleep 0.05; done; exit 1", check=False, timeout=600).stdout
    record.dpkg_audit_killed = ssh(second, "sleep 0.5; dpkg --audit", check=False).stdout
    TIMES["dpkg killed mid-install"] = time.monotonic() - started
    record.second = deploy("--limit", SECOND, "-vvv", want_json=False)
    TIMES["second box (cache hit)"] = record.second.elapsed
    journal = "journalctl -u vllm-qwen.service -o cat --no-pager"
    record.second_after = {
        "audit": ssh(second, "dpkg --audit", check=False).stdout,
        "clone": ssh(second, "test -e /opt/uncloseai/src/exllamav3", check=False).returncode,
        "imported": ssh(second, "runuser -u fox -- /opt/uncloseai/vllm-venv/bin/python -c "
                                "'import torch, exllamav3_ext; print(exllamav3_ext.__file__)'",
                        check=False).stdout,
        "kernels": list((REPO_ROOT / ".testbed/kernel-cache").glob("*/kernels.tar.sha256")),
        "good_journal": ssh(hosts[GOOD], journal, check=False).stdout,
        "second_journal": ssh(second, journal, check=False).stdout,
        "compile_cache_owner": ssh(second, "stat -c %U /home/fox/.cache/vllm/torch_compile_cache",
                                   check=False).stdout,
    }


def converge(hosts: dict[str, Host]) -> Record:
    """The fleet's first deploy, step by step, recorded."""
    record = Record()
    rate_limited_edge(record, hosts[EDGE])
    interrupted_then_full_run(record, hosts)
    second_box_from_the_cache(record, hosts)
    return record
