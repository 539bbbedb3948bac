"""What the fleet's scenarios share: the hosts and their roles, the deploy and the other commands
as the operator runs them, and the requests a client or an edge sends.

The fleet (tests/testbed/donors.yml, through inventory/testbed.py):
- tb-4090 converges: real vllm 0.26.0 + torch from PyPI in the venv, a real nvcc 13.3 (NVIDIA's
  PyPI wheels packaged as the stand-in cuda-toolkit-13-3), the stand-in exllamav3 compiled by it.
- tb-3090 stops at the CUDA step with a message naming it and the missing nvcc (PyPI has no CUDA
  12.8 compiler), while tb-4090 carries on; its apt steps first wait for apt's locks, held by
  another process for 30 s as the deploy starts (a first-boot box).
- tb-olddriver (its stand-in nvidia-smi reports an R570 driver) stops at the preflight.
- tb-4090b, whose dpkg was killed mid-install, converges from the cached exllamav3 wheel.
- tb-edge (the distro's Caddy 2.6.2, no GPU stack) spreads hermes.ai.unturf.com over tb-4090
  and tb-4090b; it is refused first with a rate limit set (its Caddy lacks the module).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from donorkit.inventory.paths import REPO_ROOT
from tests.support.deploy import Deployed, operations, run_deploy
from tests.support.hosts import Host, ssh
from tests.support.www import URL

BIN = Path(sys.executable).parent
DONORS = REPO_ROOT / "tests/testbed/donors.yml"
GOOD, BAD, SECOND, OLD = "tb-4090", "tb-3090", "tb-4090b", "tb-olddriver"
EDGE = "tb-edge"
HOSTS = [(GOOD, "10.213.0.11"), (BAD, "10.213.0.12"), (SECOND, "10.213.0.13"),
         (OLD, "10.213.0.14"), (EDGE, "10.213.0.20")]
# What OLD's stand-in nvidia-smi reports: an R570 driver, too old for the rtx4090's CUDA 13.3.
OLD_DRIVER = "570.195.03"
PKI = REPO_ROOT / ".testbed/pki"
HOSTNAME = "hermes.ai.unturf.com"  # routed by tb-4090 and tb-4090b, served by tb-edge
MODEL = "turboderp/Qwen3.8-27B-exl3"
LOG = "/var/log/caddy/access.log"
# The stand-in vLLM's load delay in tests/testbed/donors.yml (models.qwen.environment).
LOAD_DELAY = 4
FIXED_REVISION = "4ff9003a33658da90d0bc7977d0251d39075a663"  # the stand-in hub's checkpoint
# Phase times of the whole run, printed when the fleet's hosts are torn down.
TIMES: dict[str, float] = {}


def deploy(*extra: str, timeout: float = 3000, want_json: bool = True) -> Deployed:
    """The real entry point, `pyinfra -y --json ... inventory/testbed.py deploy.py`: (exit code,
    pyinfra's --json results, its log, seconds). pyinfra prints no results when every host
    failed: then want_json=False."""
    run = run_deploy(*extra, inventory="inventory/testbed.py", timeout=timeout)
    if want_json and not run.report:
        pytest.fail(f"pyinfra printed no JSON (rc {run.rc}):\n{run.log[-6000:]}")
    return run


def changed_ops(report: dict, host: str) -> list[str]:
    return operations(report, host, "success")


def failed_ops(report: dict, host: str) -> list[str]:
    return operations(report, host, "error")


def unit_start(host: Host, unit: str) -> str:
    return ssh(host, f"systemctl show -p MainPID -p ActiveEnterTimestampMonotonic {unit}").stdout


def pyinfra_as_a_user_runs_it(*args: str, answer: str | None = None,
                               env: dict[str, str] | None = None) -> tuple[int, str]:
    """pyinfra as the README gives it: no -y; with `answer`, the prompt gets that line. `args`:
    the inventory, the deploy file, then the options."""
    inventory, deploy_file, *options = args
    run = run_deploy(*options, inventory=inventory, deploy=deploy_file, json_report=False,
                     yes=False, answer=answer, env=env, timeout=1800)
    output = re.sub(r"\x1b\[[0-9;]*m", "", run.log)  # no colours
    assert "Traceback" not in output and "RuntimeError" not in output, output[-6000:]
    return run.rc, output


def preview_rows(output: str, host: str, column: str = "any") -> list[str]:
    """The operation names of pyinfra's "Detected changes" table whose "Change" column
    (column="change"), "Conditional Change" column ("conditional") or either names `host`."""
    table = output.split("--> Detected changes:", 1)[1].split("Detected changes may not", 1)[0]
    names = []
    for line in table.splitlines():
        cells = re.split(r"\s{3,}", line.strip())  # pyinfra pads columns to 3+ spaces
        if len(cells) != 3:
            continue
        wanted = {"change": cells[1:2], "conditional": cells[2:3], "any": cells[1:3]}[column]
        if any(re.search(rf"[(,] ?{re.escape(host)}[,)]", cell) for cell in wanted):
            names.append(cells[0].split(" | ", 1)[-1])
    return names


def junit_outcomes(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
        outcomes[case.get("name", "")] = outcome
    return outcomes


def curl(address: str, hostname: str, path: str, headers: str = "",
         client: bool | str = False) -> tuple[int, str, int]:
    """curl from this machine to https://hostname{path} at `address`:443, verified against the
    testbed's CA; with tb-edge's client certificate when `client` (or the one of that name under
    the testbed's pki/edges/). (status, body, curl's rc)"""
    url = shlex.quote(f"https://{hostname}{path}")
    name = EDGE if client is True else client
    cert = (f"--cert {PKI}/edges/{name}.crt --key {PKI}/edges/{name}.key " if name else "")
    result = subprocess.run(
        ["sh", "-c", f"curl -sS -m 30 -o /dev/stdout -w '\\n%{{http_code}}' {headers} {cert}"
                     f"--cacert {PKI}/ca.crt --resolve {hostname}:443:{address} {url}"],
        capture_output=True, text=True, timeout=60)
    body, _, code = result.stdout.rpartition("\n")
    return int(code or 0), body, result.returncode


def through_caddy(host: Host, hostname: str, path: str, headers: str = "") -> tuple[int, str]:
    """Straight to a donor's Caddy, as an edge: with tb-edge's client certificate (the donor
    answers nobody else)."""
    code, body, _ = curl(host.ip, hostname, path, headers, client=True)
    return code, body


def via_edge(hosts: dict[str, Host], path: str, headers: str = "") -> tuple[int, str, int]:
    """A public client's request: to the edge's address with the public hostname."""
    return curl(hosts[EDGE].ip, HOSTNAME, path, headers)


def loop_seqs(host: Host, tag: str) -> dict[int, float]:
    """{sequence number: the donor's log time} of loop requests `tag` in a donor's access log
    (the edge passes the client's X-Loop header through; the donor's Caddy logs it)."""
    seqs = {}
    for line in ssh(host, f"grep -F {shlex.quote(tag)} {LOG} || true").stdout.splitlines():
        entry = json.loads(line)
        value = entry["request"]["headers"].get("X-Loop", [""])[0]
        if value.startswith(f"{tag}-"):
            seqs[int(value.rsplit("-", 1)[1])] = entry["ts"]
    return seqs


def model_started(host: Host) -> None:
    """The qwen unit started (if it was not) and its model listed on loopback, so the next
    scenario finds the box serving."""
    ssh(host, "systemctl start vllm-qwen.service; for i in $(seq 120); do "
              "curl -sf http://127.0.0.1:18888/v1/models | grep -qF "
              f"{shlex.quote(MODEL)} && exit 0; sleep 0.5; done; exit 1")


def both_donors_in_the_pool(hosts: dict[str, Host]) -> None:
    """Both donors' models answer on loopback, then one health interval (2 s) and its timeout
    pass, so the edge has seen them answer (other scenarios stop and start them)."""
    for name in (GOOD, SECOND):
        ssh(hosts[name], "systemctl start vllm-qwen.service; for i in $(seq 120); do "
                         "curl -sf -o /dev/null http://127.0.0.1:18888/health && exit 0; "
                         "sleep 0.5; done; exit 1")
    time.sleep(2 + 5 + 1)


def hub(control: str, body: dict | None = None) -> list | dict:
    """The testbed's hub stand-in (tests/support/hub_standin.py): its controls and request log."""
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{URL}/_standin/{control}", data=data),
                                timeout=10) as response:
        return json.load(response)


def donors_variant(tmp_path: Path, names: list[str], qwen: dict) -> Path:
    """tests/testbed/donors.yml with only `names` and the qwen model changed as `qwen` says (for
    `DONORS_FILE=... pyinfra inventory/gpus.py`, the production entry point)."""
    doc = yaml.safe_load(DONORS.read_text())
    doc["donors"] = {n: doc["donors"][n] for n in names}
    model = doc["overrides"].setdefault("models", {}).setdefault("qwen", {})
    model.setdefault("environment", {}).update(qwen.pop("environment", {}))
    model.update(qwen)
    path = tmp_path / f"donors-variant-{len(list(tmp_path.glob('donors-variant-*')))}.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def rollout(donors: Path, *extra: str) -> tuple[int, str, float]:
    """`make rollout`'s command over the fleet of `donors` (the production inventory file)."""
    started = time.monotonic()
    result = subprocess.run([str(BIN / "python"), "-m", "donorkit.commands.rollout", "--inventory",
                             "inventory/gpus.py", *extra], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=1200,
                            env={**os.environ, "DONORS_FILE": str(donors)})
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def make(*args: str, donors: Path = DONORS, timeout: float = 600) -> tuple[int, str]:
    """A make target as the operator runs it (DONORS_FILE naming the fleet). Its status is
    make's: 2 when the command failed (whatever non-zero status it exited with)."""
    result = subprocess.run(["make", "-s", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "DONORS_FILE": str(donors)})
    # make's own line on a failed target ("make[1]: *** [Makefile:..: status] Error 1") out.
    output = "".join(line for line in (result.stdout + result.stderr).splitlines(keepends=True)
                     if not re.match(r"make(\[\d+\])?: \*\*\* ", line))
    return result.returncode, output


def status_json(*limit: str) -> tuple[int, dict]:
    rc, out = make("status", "JSON=1", *([f"LIMIT={','.join(limit)}"] if limit else []))
    return rc, json.loads(out[out.index("{"):])
