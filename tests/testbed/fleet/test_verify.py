"""Verify: the verification suite (tests/verify) against the fleet is green where the fleet
converged and names what failed where it did not; a unit rendered from random words runs them
through systemd exactly; a donor's Caddy serves the model to the edge, answers 502 when the
model is down, and logs no secret. Leaves the fleet serving."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

from donorkit.inventory.fleet import load_fleet
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render import templates as render
from tests.support import hosts as bed
from tests.support.hosts import Host, ssh
from tests.testbed.fleet.helpers import (
    BAD,
    BIN,
    DONORS,
    EDGE,
    GOOD,
    HOSTNAME,
    OLD,
    SECOND,
    TIMES,
    both_donors_in_the_pool,
    junit_outcomes,
    model_started,
    through_caddy,
)


def test_verification_suite(hosts: dict[str, Host], tmp_path: Path) -> None:
    """tests/verify against the fleet: all green on tb-4090, tb-4090b and the edge; tb-3090's
    missing nvcc and tb-olddriver's driver reported."""
    both_donors_in_the_pool(hosts)
    started = time.monotonic()
    junit = tmp_path / "verify.xml"
    result = subprocess.run([str(BIN / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-n", "2", "tests/verify", "--donors", str(DONORS),
                             f"--junitxml={junit}"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=900)
    TIMES["verification"] = time.monotonic() - started
    print(result.stdout[-6000:])
    outcomes = junit_outcomes(junit)
    good = {k: v for k, v in outcomes.items()
            if f"[{GOOD}" in k or f"[{SECOND}" in k or f"[{EDGE}" in k}
    bad = {k: v for k, v in outcomes.items() if f"[{BAD}" in k}
    not_passed = {k: v for k, v in good.items() if v != "passed"}
    # The only check a container cannot answer: torch cannot reach a GPU that is not there
    # (nvidia-smi's card and driver checks run against the stand-in).
    no_gpu = {f"test_torch_sees_the_gpu_as_service_user[{h}:qwen]": "skipped"
              for h in (GOOD, SECOND)}
    assert good and not_passed == no_gpu, not_passed
    for h in (GOOD, SECOND):
        assert good[f"test_driver_is_new_enough_for_the_card_cuda[{h}]"] == "passed"
    edge_checks = {k for k in good if f"[{EDGE}" in k}
    assert len(edge_checks) == 5, edge_checks  # 3 of the edge + one per donor of its hostname
    assert {k for k in good if k.startswith("test_donor_refuses_a_client_without")} == {
        f"test_donor_refuses_a_client_without_certificate[{d}:{HOSTNAME}]"
        for d in (GOOD, SECOND)}
    # A model that is not serving fails its serving checks (with the reason), never skips them.
    serving = {k: v for k, v in bad.items() if k.startswith("test_models_through_caddy")}
    assert serving and set(serving.values()) == {"failed"}, serving
    nvcc_failures = [k for k, v in bad.items() if v == "failed" and "nvcc" in k]
    assert nvcc_failures, f"tb-3090's missing nvcc was not reported as a failure: {bad}"
    assert outcomes[f"test_driver_is_new_enough_for_the_card_cuda[{OLD}]"] == "failed"


def test_unit_quoting_round_trips_through_systemd(hosts: dict[str, Host]) -> None:
    """A unit rendered like the model units (same template, same sandbox) from random args and
    environment values, whose command prints its argv and environment, started once by systemd:
    it must print exactly what the data said."""
    good = hosts[GOOD]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    alphabet = "aZ09 '\"$%\\{}[]:;,=-_./@#!?*&|<>~`é✓€"
    words = ["it's", "$HOME", "${HOME}", "$$", "50%", "%h", "%%", "a\\b", "\\", '"', ";",
             "", "  lead", '{"temperature": 0.7, "stop": ["x y"]}', "é ü ✓"]
    words += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 16)))
              for _ in range(20)]
    values = {f"RT_{i}": w for i, w in enumerate(words)}
    data = load_fleet(DONORS)[GOOD]
    data = data.model_copy(update=dict(vllm_executable="/usr/local/bin/argv-env",
                                       unit_service=dict(data.unit_service, Restart="no")))
    model = data.models["qwen"].model_copy(update=dict(args=["--x", *words],
                                                       environment=values))
    unit = "uncloseai-roundtrip.service"
    printer = (REPO_ROOT / "tests/testbed/standins/argv-env").read_text()
    for path, text in (("/usr/local/bin/argv-env", printer),
                       (f"/etc/systemd/system/{unit}", render.render_unit(data, model))):
        subprocess.run([*bed.ssh_command(good), f"cat > {path}"], input=text, text=True,
                       check=True, timeout=30)
    try:
        ssh(good, f"chmod 755 /usr/local/bin/argv-env && "
                  f"systemd-analyze verify /etc/systemd/system/{unit} && "
                  f"systemctl daemon-reload && systemctl start {unit}")
        for _ in range(100):
            if "ActiveState=inactive" in ssh(good, f"systemctl show -p ActiveState {unit}").stdout:
                break
            time.sleep(0.1)
        result = ssh(good, f"systemctl show -p Result --value {unit}; "
                           f"journalctl -q -o cat -u {unit} | grep -F argv").stdout
        status, _, printed = result.partition("\n")
        assert status == "success", (seed, result)
        got = json.loads(printed.strip().splitlines()[-1])
        assert got["argv"] == render.exec_start(data, model)[1:], seed
        assert {k: got["env"].get(k) for k in values} == values, seed
    finally:
        ssh(good, f"rm -f /etc/systemd/system/{unit} /usr/local/bin/argv-env; "
                  "systemctl daemon-reload", check=False)


def test_serving_through_caddy_502_when_down_and_scrubbed_log(hosts: dict[str, Host]) -> None:
    good = hosts[GOOD]
    model_started(good)
    code, body = through_caddy(good, "hermes.ai.unturf.com", "/v1/models")
    assert code == 200, body
    assert [m["id"] for m in json.loads(body)["data"]] == ["turboderp/Qwen3.8-27B-exl3"]

    secret = "s3cr3t-value-7f1e"
    code, _ = through_caddy(good, "hermes.ai.unturf.com", f"/version?key={secret}&x=1",
                            f"-H 'Authorization: Bearer {secret}' -H 'Cookie: c={secret}' "
                            f"-H 'Api-Key: {secret}' -H 'X-Api-Key: {secret}'")
    assert code == 200
    # The edge's health checks are logged too: the request's own line.
    log = ssh(good, "sleep 0.5; grep -F /version /var/log/caddy/access.log | tail -n 1").stdout
    assert "/version" in log and secret not in log
    assert "key=REDACTED&x=REDACTED" in log, log

    ssh(good, "systemctl stop vllm-qwen.service")
    try:
        code, body = through_caddy(good, "hermes.ai.unturf.com", "/v1/models")
        assert code == 502 and body == ""
    finally:
        model_started(good)
