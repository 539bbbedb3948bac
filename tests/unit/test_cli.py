"""`donors` (donorkit/commands/cli.py), run as the operator runs it: the installed console script,
and through make. Real subprocesses, real files; the boxes are refused local ports (nothing
listens)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from donorkit.inventory import errors
from donorkit.inventory.paths import REPO_ROOT
from tests.support.make import make
from tests.unit import test_lock

DONORS = Path(sys.executable).parent / "donors"
ACTIONS = ["init", "deploy", "render", "status", "pin", "verify", "accept", "reference", "rollout",
           "join-file", "join"]
# The hub stand-in (tests/support/hub_standin.py), test_lock's fixtures.
hub_root, hub, QWEN = test_lock.hub_root, test_lock.hub, test_lock.QWEN
PIN = "0123456789abcdef0123456789abcdef01234567"


def donors(*args: str, env: dict | None = None, cwd: Path = REPO_ROOT
           ) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("DONORS_FILE", "DONORS_FLEET")}
    return subprocess.run([str(DONORS), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**clean, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The command's stderr is exactly one `donors: ` line, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("donors: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_help_lists_every_action_and_the_exit_codes() -> None:
    result = donors("--help")
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^    ([a-z-]+)", result.stdout, re.MULTILINE)
    assert listed == ACTIONS, result.stdout
    block = result.stdout.split("  ACTION\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(block) == len(ACTIONS), block      # one line each (at 80 columns)
    assert "(or: lock)" in result.stdout    # pin's old name, for `make lock`'s operators
    assert errors.EXIT_CODES in result.stdout


@pytest.mark.parametrize("action", [*ACTIONS, "lock"])
def test_each_action_has_its_help(action: str) -> None:
    result = donors(action, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: donors {action} "), result.stdout


def test_init_makes_a_fleet_and_never_overwrites_it(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    made = donors("init", str(fleet))
    assert made.returncode == 0, made.stderr
    doc = yaml.safe_load((fleet / "donors.yml").read_text())
    example = yaml.safe_load((REPO_ROOT / "inventory/donors.yml").read_text())
    assert doc["donors"] == example["donors"] and doc["edges"] == example["edges"]
    # The served models' pins live in the fleet, where `donors pin` writes them.
    assert set(doc["overrides"]["models"]) == {"qwen"}
    assert "revision" in doc["overrides"]["models"]["qwen"]
    (fleet / "donors.yml").write_text("mine\n")
    again = donors("init", str(fleet))
    assert again.returncode == errors.USAGE
    assert one_error_line(again) == (f"donors: {fleet / 'donors.yml'}: already exists: a fleet "
                                     "is never overwritten")
    assert (fleet / "donors.yml").read_text() == "mine\n"


def test_pin_writes_into_the_fleet_not_the_toolkit(tmp_path: Path, hub) -> None:
    """A fleet made by init pins its models in its own donors.yml (the toolkit's defaults.yml,
    which a `git pull` replaces, stays as it is). The hub: tests/support/hub_standin.py."""
    url, state = hub
    fleet = tmp_path / "fleet"
    assert donors("init", str(fleet)).returncode == 0
    path = fleet / "donors.yml"
    path.write_text(path.read_text().replace("overrides:\n", f"overrides:\n  hf_endpoint: {url}\n"
                                             "  hf_endpoint_plain_http_test_standin: true\n", 1))
    defaults = (REPO_ROOT / "inventory/defaults.yml").read_text()
    result = donors("--fleet", str(fleet), "lock")          # the old name, the same action
    assert result.returncode == 0, result.stderr
    commit = state.repos[QWEN].commit
    doc = yaml.safe_load(path.read_text())
    assert doc["overrides"]["models"]["qwen"] == {"checkpoint": QWEN, "revision": commit}
    assert (REPO_ROOT / "inventory/defaults.yml").read_text() == defaults


def _fleet(tmp_path: Path, **overrides: object) -> Path:
    """A fleet directory with one donor and one edge on refused local ports."""
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "plugin").mkdir()
    doc = {"overrides": {"vllm_exl3_plugin": {"path": "plugin"},
                         "models": {"qwen": {"revision": PIN}}, **overrides},
           "donors": {"box": {"ssh_host": "127.0.0.1", "ssh_port": free_port(),
                              "ssh_user": "root", "card": "rtx4090",
                              "routes": {"h.example.com": "qwen"}}},
           "edges": {"front": {"ssh_host": "127.0.0.2", "ssh_port": free_port(),
                               "ssh_user": "root", "hostnames": "all", "rate_limit": None}}}
    (fleet / "donors.yml").write_text(yaml.safe_dump(doc))
    return fleet


def test_a_fleets_relative_paths_are_inside_it(tmp_path: Path) -> None:
    """pki_dir (and every operator path) is taken from the fleet directory: render writes the
    private CA there, never in the checkout; the plugin's relative path is the fleet's."""
    fleet = _fleet(tmp_path, pki_dir="my-pki")
    before = (REPO_ROOT / "my-pki").exists()
    result = donors("--fleet", str(fleet), "render", "box", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (fleet / "my-pki" / "ca.key").is_file() and (fleet / "my-pki" / "ca.crt").is_file()
    assert (REPO_ROOT / "my-pki").exists() == before
    # The same through the environment variable, from any directory.
    again = donors("render", "front", str(tmp_path / "out-edge"), env={"DONORS_FLEET": str(fleet)},
                   cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "out-edge/etc/caddy/tls/ca.crt").read_text() == \
        (fleet / "my-pki/ca.crt").read_text()
    # The plugin path is the fleet's: gone from there, the deploy is refused naming the field.
    (fleet / "plugin").rmdir()
    refused = donors("--fleet", str(fleet), "deploy", "--dry")
    assert refused.returncode == errors.USAGE
    assert one_error_line(refused) == (
        f"donors: {fleet / 'donors.yml'}: field 'overrides.vllm_exl3_plugin': local path "
        f"{fleet / 'plugin'} does not exist on this machine: the vllm-exl3 plugin's checkout "
        "(README \"Prerequisites\"), or set {git_url, ref} instead")


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    text = (fleet / "donors.yml").read_text()
    (fleet / "donors.yml").write_text(text.replace("card: rtx4090", "card: rtx4091"))
    for action in (["status"], ["deploy", "-y"], ["pin"], ["verify"], ["accept"],
                   ["render", "box", str(tmp_path / "out")]):
        result = donors("--fleet", str(fleet), *action)
        assert result.returncode == errors.USAGE, (action, result.stderr)
        assert one_error_line(result).startswith(
            f"donors: {fleet / 'donors.yml'}: donor 'box': field 'card': unknown card "
            "'rtx4091'"), action
    missing = donors("--fleet", str(tmp_path / "nowhere"), "status")
    assert missing.returncode == errors.USAGE
    assert "not a fleet directory" in one_error_line(missing)


@pytest.mark.parametrize("action", ["deploy", "status", "verify", "accept"])
def test_a_mistyped_limit_is_refused(tmp_path: Path, action: str) -> None:
    """Exit 2 and one line, before pyinfra (or anything) runs: never exit 0 having done nothing."""
    fleet = _fleet(tmp_path)
    result = donors("--fleet", str(fleet), action, "--limit", "boxx", *(["-y"] * (
        action == "deploy")))
    assert result.returncode == errors.USAGE, result.stdout + result.stderr
    assert one_error_line(result).startswith("donors: limit 'boxx' matches no host (hosts: "
                                             "box, front;")
    assert "-->" not in result.stdout     # pyinfra never started


def test_status_json_is_clean_through_make(tmp_path: Path) -> None:
    """`make status JSON=1 | jq .`: stdout is one JSON document (every box unreachable here:
    exit 1 from donors, 2 through make)."""
    fleet = _fleet(tmp_path)
    direct = donors("--fleet", str(fleet), "status", "--json", "--timeout", "3")
    assert direct.returncode == errors.FAILED, direct.stderr
    assert [h["name"] for h in json.loads(direct.stdout)["hosts"]] == ["box", "front"]
    result = subprocess.run(make("status", "JSON=1", f"FLEET={fleet}"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and all("unreachable" in h for h in doc["hosts"])
    assert result.returncode == 2          # make's own code for any failure


def test_status_table_fits_100_columns(tmp_path: Path) -> None:
    from donorkit.commands.status_view import render_table

    model = {"unit": "vllm-qwen.service", "state": "active", "active_for_s": 7200,
             "checkpoint": "turboderp/Qwen3.8-27B-exl3", "revision": PIN, "pinned": PIN,
             "ready": True, "metrics": {"vllm:num_requests_running": 2.0,
                                        "vllm:num_requests_waiting": 0.0,
                                        "vllm:kv_cache_usage_perc": 0.31},
             "cert_expires": "2027-01-01T00:00:00"}
    row = {"name": "hermes-4090", "role": "donor", "models": [model, {**model, "revision": None,
                                                                        "ready": False,
                                                                        "problem": "x" * 200}],
           "gpu": {"card": "NVIDIA GeForce RTX 4090", "driver": "580.95.05",
                   "memory_used_mib": 20000, "memory_total_mib": 24564,
                   "utilization_pct": 87},
           "vllm": "0.26.0", "torch": "2.9.0+cu129", "toolkit": "0.4.0", "drained": False}
    edge = {"name": "edge-1", "role": "edge", "caddy": "v2.11.7", "toolkit": "0.4.0",
            "pool": [{"hostname": "hermes.ai.unturf.com", "donor": "hermes-4090",
                      "address": "198.51.100.40:8443", "seen": "up", "in_flight": 3}]}
    narrow = render_table([row, edge], wide=False).splitlines()
    assert max(map(len, narrow[:3] + narrow[4:])) <= 100, "\n".join(narrow)
    assert narrow[0].split() == ["DONOR", "CARD", "UNIT", "SINCE", "REVISION", "READY",
                                 "RUN/WAIT", "KV", "CANARY"]
    assert PIN[:12] in narrow[1] and "none!" in narrow[2]   # not the inventory's pin: marked
    assert narrow[1].split()[-4:] == ["yes", "2/0", "31%", "-"] and " NO " in narrow[2]
    assert narrow[3].startswith("hermes-4090 vllm-qwen: NO: xxx")   # why, under the table
    wide = render_table([row, edge]).splitlines()
    assert max(map(len, wide)) > 100 and "TORCH" in wide[0]


def test_a_silent_ssh_port_is_one_line(tmp_path: Path) -> None:
    """A box whose SSH port accepts and says nothing: pyinfra's one `SSH error` line for it, not
    paramiko's traceback; the deploy exits 1 (a box failed, the input was fine)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)                 # the kernel completes the handshake; nobody speaks
        fleet = tmp_path / "fleet"
        (fleet / "plugin").mkdir(parents=True)
        (fleet / "donors.yml").write_text(yaml.safe_dump({
            "overrides": {"vllm_exl3_plugin": {"path": "plugin"},
                          "models": {"qwen": {"revision": PIN}}},
            "donors": {"box": {"ssh_host": "127.0.0.1", "ssh_port": silent.getsockname()[1],
                               "ssh_user": "root", "card": "rtx4090",
                               "routes": {"h.example.com": "qwen"}}}}))
        result = donors("--fleet", str(fleet), "deploy", "--dry", "-y")
    out = result.stdout + result.stderr
    assert result.returncode == errors.FAILED, out
    assert "Traceback" not in out and "paramiko" not in out, out
    assert [line.strip() for line in out.splitlines() if "[box]" in line] == [
        "[box] SSH error (No existing session)"], out
