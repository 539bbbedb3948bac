"""`make accept` for a home donor behind NAT (`reach: tunnel`): its Caddy is at its tunnel address,
which only its edge reaches. The route (the donor's Caddy through the edge's SSH forward, mutual
TLS as for any donor), the OpenSSH argv, and the whole command against a real OpenSSH client
forwarding through a real SSH server on loopback (tests/support/loopback_sshd.py) to a TLS server
that requires our client CA's certificate, standing in for the donor's Caddy at its tunnel
address (a loopback address here: the pool is 127.77.0.0/16)."""

from __future__ import annotations

import base64
import ipaddress
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from donorkit.commands import accept as a
from donorkit.commands import accept_records as core
from donorkit.commands import transport
from donorkit.commands.transport import ForwardError, SshForward, free_port, wait_until
from donorkit.inventory import tunnel_plan, tunnel_values
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.host_data import SshJump
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from donorkit.inventory.ssh_commands import forward_command
from tests.support import loopback_sshd, version_server

SOURCE = REPO_ROOT / "tests/testbed/donors-tunnel.yml"
HOSTNAME = "hermes.ai.unturf.com"
TUNNEL = "127.77.0.9"   # tb-home's tunnel address here: loopback, as only "the edge" reaches


@pytest.fixture(autouse=True)
def loopback_tunnel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for the tunnel, which cannot exist here (no WireGuard between loopback
    addresses): its pool on loopback, its edge dialled at 127.0.0.1. The inventory refuses both
    for a real fleet (tunnel_values.PRIVATE_POOLS, tunnel_plan.undialable): allowed for this test
    only."""
    monkeypatch.setattr(tunnel_values, "PRIVATE_POOLS",
                        (*tunnel_values.PRIVATE_POOLS, ipaddress.IPv4Network("127.77.0.0/16")))
    monkeypatch.setattr(tunnel_plan, "undialable", lambda ip: False)


def donors_file(tmp_path: Path, edits: dict | None = None, edge: dict | None = None) -> Path:
    """The testbed's home-donor fleet, joined (keys pasted), with this test's PKI and `edits`
    to the overrides and `edge` to tb-edge's entry."""
    doc = yaml.safe_load(SOURCE.read_text())
    doc["overrides"].update({"pki_dir": str(tmp_path / "pki"),
                             "tunnel": {"pool": "127.77.0.0/16"}, **(edits or {})})
    doc["edges"]["tb-edge"].update(
        tunnel_public_key=base64.b64encode(bytes(range(32))).decode(), **(edge or {}))
    doc["donors"]["tb-home"].update(
        tunnel_public_key=base64.b64encode(bytes(range(1, 33))).decode(),
        tunnel_address=TUNNEL)
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_home_donor_is_measured_on_its_caddy_through_the_edges_ssh(tmp_path: Path) -> None:
    """tb-edge spreads the hostname over tb-home and tb-never: tb-home is measured on its own
    Caddy, at its tunnel address, with the operator's client certificate, through tb-edge's
    SSH (its ssh_jump) with the edge's own SSH data."""
    fleet, edges = load_inventory(donors_file(tmp_path))
    [target] = core.targets_from_fleet({"tb-home": fleet["tb-home"]}, None, edges)
    assert target.base_url == f"https://{TUNNEL}:443" and target.hostname == HOSTNAME
    assert target.client == (str(tmp_path / "pki/edges/operator-accept.crt"),
                             str(tmp_path / "pki/edges/operator-accept.key"))
    assert target.ca_file == str(tmp_path / "pki/ca.crt")
    assert target.route == (
        f"to the donor's Caddy at {TUNNEL}:443 through edge tb-edge's SSH forward, with client "
        f"certificate {OPERATOR_CLIENT} (edge tb-edge spreads it over 2 donors (tb-home, "
        "tb-never))")
    forward = target.forward
    assert (forward.edge, forward.address, forward.port) == ("tb-edge", TUNNEL, 443)
    assert forward.jump == fleet["tb-home"].ssh_jump_data
    assert forward_command(forward.jump, 40123, forward.address, forward.port) == [
        "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=10", "-p", "22",
        "-i", str(REPO_ROOT / ".testbed/ssh/id_ed25519"), "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={REPO_ROOT}/.testbed/known_hosts",
        "-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:40123:{TUNNEL}:443",
        "root@10.213.0.20"]
    # The same -W words as its SSH and `make status` use, less the stream's own.
    assert forward_command(forward.jump, 1, TUNNEL, 443)[:14] == \
        fleet["tb-home"].caddy_proxy_command[:14]


def test_a_home_donor_alone_behind_an_unlimited_edge_goes_through_the_edge(
        tmp_path: Path) -> None:
    """With tb-never gone, tb-edge's site has tb-home alone and no rate limit: through the
    edge's public port, as for a direct donor; no SSH forward."""
    path = donors_file(tmp_path)
    doc = yaml.safe_load(path.read_text())
    del doc["donors"]["tb-never"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    fleet, edges = load_inventory(path)
    [target] = core.targets_from_fleet(fleet, None, edges)
    assert (target.base_url, target.client, target.forward) == ("https://10.213.0.20:443",
                                                                None, None)
    assert target.route.startswith("through edge tb-edge (this donor is its only upstream")
    # --via wins: no forward either.
    [target] = core.targets_from_fleet(fleet, "https://edge.example", edges)
    assert target.forward is None


@pytest.fixture
def home_caddy(tmp_path: Path) -> Iterator[version_server.VersionServer]:
    """The donor's Caddy at the tunnel address: a certificate of our CA for the public name,
    only a client certificate of our client CA let in."""
    with version_server.serve(Pki(tmp_path / "pki"), "tb-home", HOSTNAME, "0.26.0-standin",
                              tmp_path, address=TUNNEL, client_ca=True) as caddy:
        yield caddy


@pytest.fixture
def edge_sshd(tmp_path: Path) -> Iterator[loopback_sshd.LoopbackSshd]:
    (tmp_path / "sshd").mkdir()
    with loopback_sshd.serve(tmp_path / "sshd") as sshd:
        yield sshd


def _edge(sshd: loopback_sshd.LoopbackSshd, known_hosts: Path | None = None) -> dict:
    """tb-edge's entry at the loopback SSH server, with its key and known_hosts."""
    return {"ssh_host": "127.0.0.1", "ssh_port": sshd.port, "ssh_key": str(sshd.client_key),
            "ssh_known_hosts_file": str(known_hosts or sshd.known_hosts)}


def test_accept_measures_a_home_donor_through_one_ssh_forward(
        tmp_path: Path, home_caddy, edge_sshd, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """`make accept --limit tb-home`: every request (the probe's handshake, then the
    measurement's; here a few GETs of /version with accept's own client) goes through one SSH
    connection to the edge, each on a channel to the tunnel address, with the public name as
    SNI and Host and the operator's client certificate; the record says which way; ssh is gone
    afterwards."""
    port = home_caddy.port
    seen: list[str] = []

    async def a_few_requests(target: core.Target, progress) -> dict:
        seen.append(target.base_url)
        client, http = a._client(target)
        async with client:
            versions = [(await http.get(f"{target.base_url}/version")).json()
                        for _ in range(3)]
        return {"figures": {}, "checks": {"version": {"ok": True, "required": True}},
                "details": {"version": versions[-1]}}

    monkeypatch.setattr(a, "_measure_reached", a_few_requests)
    path = donors_file(tmp_path, {"caddy_https_port": port}, _edge(edge_sshd))
    rc = a.main(["--donors", str(path), "--limit", "tb-home", "--results",
                 str(tmp_path / "results")])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    [record_file] = (tmp_path / "results").glob("tb-home-*.json")
    record = core.Record.model_validate_json(record_file.read_text())
    assert record.via == f"https://{TUNNEL}:{port}"
    assert record.route.startswith(f"to the donor's Caddy at {TUNNEL}:{port} through edge "
                                   f"tb-edge's SSH forward, with client certificate "
                                   f"{OPERATOR_CLIENT} (edge tb-edge spreads it over 2 donors")
    assert record.results["qwen"].details["version"] == {"version": "0.26.0-standin"}
    # The client connected to the forward's end here; the edge opened every channel to the
    # tunnel address; one SSH connection for all of them.
    [base] = seen
    assert base.startswith("https://127.0.0.1:") and base != f"https://127.0.0.1:{port}"
    assert set(edge_sshd.opened) == {(TUNNEL, port)} and len(edge_sshd.opened) >= 4
    assert len(edge_sshd.sessions) == 1
    assert set(home_caddy.names) == {HOSTNAME} and home_caddy.hosts == [HOSTNAME] * 3
    deadline = time.monotonic() + 10
    while edge_sshd.sessions[0].is_active() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not edge_sshd.sessions[0].is_active()  # the forward was stopped


def test_an_unreachable_home_donor_is_one_line(tmp_path: Path, edge_sshd,
                                               capsys: pytest.CaptureFixture) -> None:
    """Nothing at the tunnel address's Caddy port (the box down behind its edge): the edge's
    channel fails, and accept says so in one line with ssh's words; no record."""
    dead = free_port(TUNNEL)
    Pki(tmp_path / "pki").server_cert("tb-home", [HOSTNAME])  # our CA, as the deploy made it
    path = donors_file(tmp_path, {"caddy_https_port": dead}, _edge(edge_sshd))
    rc = a.main(["--donors", str(path), "--limit", "tb-home", "--results",
                 str(tmp_path / "results")])
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"UNREACHABLE tb-home (edge tb-edge's SSH forward to "
                               f"{TUNNEL}:{dead}: "), lines
    assert "(ssh: channel " in lines[0] and "open failed: connect failed" in lines[0], lines
    assert not list((tmp_path / "results").glob("*.json"))


def test_an_edge_whose_host_key_is_not_known_is_one_line(tmp_path: Path, edge_sshd,
                                                         capsys: pytest.CaptureFixture) -> None:
    """The edge's host key not in its known_hosts file: ssh refuses (no prompt: BatchMode),
    the forward never comes up, and accept says so in one line."""
    (tmp_path / "empty_known_hosts").write_text("")
    Pki(tmp_path / "pki").server_cert("tb-home", [HOSTNAME])
    path = donors_file(tmp_path, {}, _edge(edge_sshd, tmp_path / "empty_known_hosts"))
    rc = a.main(["--donors", str(path), "--limit", "tb-home", "--results",
                 str(tmp_path / "results")])
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert rc == 1 and lines == [
        f"UNREACHABLE tb-home (edge tb-edge's SSH forward to {TUNNEL}:443: ssh to "
        f"root@127.0.0.1:{edge_sshd.port} exited with status 255: Host key verification "
        "failed.)"], lines


def test_a_forward_whose_port_is_taken_fails_at_once(tmp_path: Path, edge_sshd,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ExitOnForwardFailure: a local port already taken ends ssh at once with its reason,
    rather than a session that forwards nothing."""
    taken = socket.socket()  # bound, not listening: nothing answers there but ssh may not bind
    taken.bind(("127.0.0.1", 0))
    picked: list[int] = []
    monkeypatch.setattr(transport, "free_port",
                        lambda: picked.append(taken.getsockname()[1]) or picked[-1])
    started = time.monotonic()
    with pytest.raises(ForwardError, match="exited with status 255: .*(forward|in use)"):
        with SshForward(_jump(edge_sshd), TUNNEL, 443):
            pass
    assert time.monotonic() - started < 10
    assert len(picked) == SshForward.PORT_TRIES  # each try found it taken
    taken.close()


def _jump(sshd: loopback_sshd.LoopbackSshd) -> SshJump:
    return SshJump(**{"ssh_user": "root", "ssh_hostname": "127.0.0.1",
                      **{k: v for k, v in _edge(sshd).items() if k != "ssh_host"}})


def test_a_local_port_taken_before_ssh_binds_it_is_picked_again(
        edge_sshd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race between the kernel's pick and ssh's bind: the first pick was taken meanwhile,
    ssh exits saying so, and the forward comes up on the next pick."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    picks = iter([taken.getsockname()[1], free_port()])
    monkeypatch.setattr(transport, "free_port", lambda: next(picks))
    with SshForward(_jump(edge_sshd), TUNNEL, 443) as forward:
        assert forward.local_port != taken.getsockname()[1]
        socket.create_connection(("127.0.0.1", forward.local_port), 3).close()
    taken.close()


def test_ssh_ends_when_the_command_that_started_it_is_killed(tmp_path: Path, edge_sshd) -> None:
    """A `make accept` killed outright (SIGKILL: no `with` exit runs) leaves no ssh -N behind:
    ssh gets the parent-death signal."""
    script = (
        "import json, sys, time\n"
        "from donorkit.inventory.host_data import SshJump\n"
        "from donorkit.commands.transport import SshForward\n"
        "with SshForward(SshJump(**json.loads(sys.argv[1])), sys.argv[2], 443) as forward:\n"
        "    print(forward._process.pid, flush=True)\n"
        "    time.sleep(60)\n")
    command = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(_jump(edge_sshd).model_dump(mode="json")),
         TUNNEL], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        ssh = int(command.stdout.readline())
        assert Path(f"/proc/{ssh}").exists()
        command.kill()
        command.wait()
        gone = wait_until(lambda: None if not _alive(ssh) else f"ssh {ssh} still runs", 5, 0.1)
        assert gone is None, gone
    finally:
        command.kill()
        command.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended (its parent, this test, did not reap it)
