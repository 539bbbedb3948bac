"""Home donors behind NAT (donorkit/inventory/tunnel_plan.py), host-free: the data (addresses from
the pool, stable and unique, the one-line refusals), what each box gets (WireGuard config without a
private key, the nftables table through the real `nft -c`, Caddy bound to the tunnel and
loopback, the edge's upstream at the tunnel address), SSH through the edge, and
the tunnel's operations (facts in, commands out)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from donorkit.box.tunnel_operations import (
    firewall_loaded,
    tunnel_key_is,
    tunnel_running,
    userspace_wireguard,
    wireguard_key,
)
from donorkit.inventory import tunnel_plan
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render import templates as render
from donorkit.render import tunnel_files
from pyinfra_declared.json_cases import plan, refusal_message
from tests.support.rendered_shape import adapt, in_tmp, lay_out

SOURCE = REPO_ROOT / "tests/testbed/donors-tunnel.yml"
KEY_A = base64.b64encode(bytes(range(32))).decode()
KEY_B = base64.b64encode(bytes(range(1, 33))).decode()


def donors_file(tmp_path: Path, change=None) -> Path:
    doc = yaml.safe_load(SOURCE.read_text())
    doc["overrides"]["pki_dir"] = str(tmp_path / "pki")
    doc["edges"]["tb-edge"]["tunnel_public_key"] = KEY_A
    doc["donors"]["tb-home"]["tunnel_public_key"] = KEY_B
    if change:
        change(doc)
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def refused(tmp_path: Path, change) -> str:
    with pytest.raises(FleetError) as caught:
        load_inventory(donors_file(tmp_path, change))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_addresses_come_from_the_pool_and_stay_put(tmp_path: Path) -> None:
    fleet, edges = load_inventory(donors_file(tmp_path))
    home, never, edge = fleet["tb-home"], fleet["tb-never"], edges["tb-edge"]
    addresses = [home.tunnel_address, never.tunnel_address, edge.tunnel_address]
    assert len(set(addresses)) == 3
    assert all(a.startswith("10.77.") for a in addresses)
    assert home.tunnel_address == tunnel_plan.derived_address("10.77.0.0/16", "tb-home")

    def add_one(doc):  # another donor joins: nobody else's address moves
        doc["donors"]["tb-other"] = dict(doc["donors"]["tb-never"])
    (tmp_path / "2").mkdir()
    fleet2, edges2 = load_inventory(donors_file(tmp_path / "2", add_one))
    assert fleet2["tb-home"].tunnel_address == home.tunnel_address
    assert edges2["tb-edge"].tunnel_address == edge.tunnel_address


def test_a_derived_address_is_never_the_network_or_broadcast() -> None:
    for name in (f"box-{i}" for i in range(2000)):
        address = tunnel_plan.derived_address("10.77.0.0/28", name)
        assert tunnel_plan.check_address("10.77.0.0/28", address) is None, (name, address)


def test_the_edge_proxies_to_the_tunnel_address_and_the_box_is_reached_through_the_edge(
        tmp_path: Path) -> None:
    fleet, edges = load_inventory(donors_file(tmp_path))
    home = fleet["tb-home"]
    upstreams = {u.donor: u.address for u in edges["tb-edge"].sites[0].upstreams}
    assert upstreams["tb-home"] == f"{home.tunnel_address}:443"
    # Never joined: still in the pool (down at the edge), but no peer of the edge's.
    assert "tb-never" in upstreams
    assert [p.name for p in edges["tb-edge"].tunnel.peers] == ["tb-home"]
    assert home.ssh_hostname == home.tunnel_address
    command = home.ssh_proxy_command
    assert command[0] == "ssh"
    assert command[-3:] == ["-W", f"{home.tunnel_address}:22", "root@10.213.0.20"]
    assert "StrictHostKeyChecking=yes" in command and "BatchMode=yes" in command
    config = tunnel_files.ssh_config(home)
    assert (f"Host {home.tunnel_address}\n    ProxyJump uncloseai-jump-tb-edge\n"
            in config)
    assert "Host uncloseai-jump-tb-edge\n    HostName 10.213.0.20\n" in config
    assert f"UserKnownHostsFile {REPO_ROOT}/.testbed/known_hosts" in config


def test_pyinfra_jumps_through_the_edge_with_the_edges_own_ssh_data(tmp_path: Path) -> None:
    """pyinfra's own ssh_config reading (its connector's parse_config, paramiko's SSHConfig)
    of the written file: the donor through the edge's alias; the edge at its address, with its
    key and known_hosts, host keys checked."""
    from pyinfra.connectors.sshuserclient.client import SSHClient, get_ssh_config

    fleet, _ = load_inventory(donors_file(tmp_path))
    path = tunnel_files.write_ssh_config(fleet["tb-home"], tmp_path / "ssh")
    config = get_ssh_config(path)
    target = config.lookup(fleet["tb-home"].tunnel_address)
    assert target["proxyjump"] == "uncloseai-jump-tb-edge"
    hop = config.lookup("uncloseai-jump-tb-edge")
    assert hop["hostname"] == "10.213.0.20" and hop["stricthostkeychecking"] == "yes"
    assert hop["identityfile"] == [str(REPO_ROOT / ".testbed/ssh/id_ed25519")]
    hostname, port = SSHClient.derive_shorthand(config, "uncloseai-jump-tb-edge")
    # Port 22 left out: paramiko compares the hop's port with the int 22 to spell its
    # known_hosts entry; pyinfra would pass a written Port as the string "22".
    assert (hostname, port["port"], port["username"]) == ("uncloseai-jump-tb-edge", 22, "root")
    assert (tmp_path / "ssh").stat().st_mode & 0o777 == 0o700


def test_direct_donors_are_unchanged(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO_ROOT / "tests/testbed/donors.yml").read_text())
    doc["overrides"]["pki_dir"] = str(tmp_path / "pki")  # the render issues certificates there
    (tmp_path / "donors.yml").write_text(yaml.safe_dump(doc))
    fleet, edges = load_inventory(tmp_path / "donors.yml")
    assert all(data.tunnel is None for data in [*fleet.values(), *edges.values()])
    assert "bind" not in render.render_caddyfile(fleet["tb-4090"])
    assert "wg-quick" not in render.render_caddy_drop_in(fleet["tb-4090"])


def test_the_wireguard_configs_hold_no_private_key(tmp_path: Path) -> None:
    fleet, edges = load_inventory(donors_file(tmp_path))
    donor_conf = tunnel_files.render_conf(fleet["tb-home"].tunnel)
    edge_conf = tunnel_files.render_conf(edges["tb-edge"].tunnel)
    for conf in (donor_conf, edge_conf):
        assert "PrivateKey" not in conf
        assert "PostUp = wg set %i private-key /etc/wireguard/wg-uncloseai.key" in conf
    assert f"PublicKey = {KEY_A}" in donor_conf and "Endpoint = 10.213.0.20:51820" in donor_conf
    assert "PersistentKeepalive = 25" in donor_conf and "ListenPort" not in donor_conf
    assert f"PublicKey = {KEY_B}" in edge_conf and "ListenPort = 51820" in edge_conf
    assert f"Address = {edges['tb-edge'].tunnel_address}/16" in edge_conf
    assert f"AllowedIPs = {fleet['tb-home'].tunnel_address}/32" in edge_conf


@pytest.mark.skipif(os.geteuid() != 0, reason="nft -c needs root (as root, make test installs nft)")
def test_the_firewall_tables_pass_nft(tmp_path: Path) -> None:
    fleet, edges = load_inventory(donors_file(tmp_path))
    for name, data in (("donor", fleet["tb-home"]), ("edge", edges["tb-edge"])):
        path = tmp_path / f"{name}.nft"
        path.write_text(tunnel_files.render_nft(data.tunnel))
        result = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, (name, result.stderr)
    donor_rules = (tmp_path / "donor.nft").read_text()
    edge_address = edges["tb-edge"].tunnel_address
    assert (f'iifname "wg-uncloseai" ip saddr {{ {edge_address} }} tcp dport {{ 443, 22 }} '
            "accept") in donor_rules
    assert 'iifname "wg-uncloseai" drop' in donor_rules
    assert 'oifname "wg-uncloseai" drop' in (tmp_path / "edge.nft").read_text()


def test_a_tunnelled_donors_caddy_binds_the_tunnel_and_loopback(tmp_path: Path) -> None:
    fleet, _ = load_inventory(donors_file(tmp_path))
    home = fleet["tb-home"]
    caddyfile = render.render_caddyfile(home)
    assert f"\tbind {home.tunnel_address} 127.0.0.1\n" in caddyfile
    path, _ = lay_out(in_tmp(home, tmp_path), tmp_path)
    [server] = adapt(path)["apps"]["http"]["servers"].values()
    assert sorted(server["listen"]) == sorted([f"{home.tunnel_address}:443", "127.0.0.1:443"])
    drop_in = render.render_caddy_drop_in(home)
    assert "After=wg-quick@wg-uncloseai.service" in drop_in


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d["donors"]["tb-home"].update(ssh_host="203.0.113.9"),
     "donor 'tb-home': field 'ssh_host': a tunnelled donor is reached at its tunnel address"),
    (lambda d: d["donors"]["tb-home"].pop("reach"),
     "donor 'tb-home': field 'ssh_host': missing"),
    (lambda d: d["donors"]["tb-home"].update(tunnel_public_key="abc="),
     "donor 'tb-home': field 'tunnel_public_key': 'abc=' is not a WireGuard public key"),
    (lambda d: d["donors"]["tb-home"].update(tunnel_address="10.78.0.5"),
     "donor 'tb-home': field 'tunnel_address': 10.78.0.5 is not inside the tunnel pool "
     "10.77.0.0/16"),
    (lambda d: d["donors"]["tb-home"].update(tunnel_address="10.77.255.255"),
     "donor 'tb-home': field 'tunnel_address': 10.77.255.255 is the pool's broadcast address"),
    (lambda d: d["donors"]["tb-never"].update(
        tunnel_address=tunnel_plan.derived_address("10.77.0.0/16", "tb-home")),
     "donor 'tb-never': field 'tunnel_address': 10.77.45.71 is also the tunnel address of "
     "donor 'tb-home'"),
    (lambda d: d["edges"]["tb-edge"].update(hostnames=["qwen.ai.unturf.com"]) or
     d["donors"]["tb-never"].update(routes={"qwen.ai.unturf.com": "qwen"}),
     "donor 'tb-home': field 'reach': a tunnelled donor is reached only through an edge"),
    (lambda d: d["overrides"].update(tunnel={"interface": "wg uncloseai"}),
     "field 'overrides.tunnel.interface': 'wg uncloseai' is not an interface name"),
    (lambda d: d["overrides"].update(tunnel={"pool": "8.8.0.0/16"}),
     "field 'overrides.tunnel.pool': '8.8.0.0/16': the tunnel pool must be a private"),
    (lambda d: d["donors"]["tb-never"].update(overrides={"tunnel": {"pool": "10.99.0.0/16"}}),
     "one tunnel pool for the whole fleet"),
    (lambda d: d["edges"]["tb-edge"].update(tunnel_endpoint="-oProxyCommand=x"),
     "edge 'tb-edge': field 'tunnel_endpoint'"),
])
def test_bad_tunnel_data_is_one_line_naming_file_host_and_field(tmp_path: Path, change,
                                                                  expected: str) -> None:
    message = refused(tmp_path, change)
    assert expected in message, message
    assert str(tmp_path / "donors.yml") in message


def test_a_direct_donor_may_not_carry_tunnel_fields(tmp_path: Path) -> None:
    def change(doc):
        doc["donors"]["tb-direct"] = {"ssh_host": "10.213.0.40", "ssh_user": "root",
                                      "card": "rtx4090", "tunnel_public_key": KEY_A,
                                      "routes": {"hermes.ai.unturf.com": "qwen"}}
    assert "donor 'tb-direct': field 'tunnel_public_key': only for a donor with reach: " \
           "tunnel" in refused(tmp_path, change)


# The join file: tests/unit/test_join_file.py.


# ------------------------------------------------------------------ operations ----------------

KEY, PUB = "/etc/wireguard/wg0.key", "/etc/wireguard/wg0.pub"
REGULAR = {"type": "regular file", "user": "root", "group": "root", "mode": "600"}


def test_the_key_pair_is_made_once_on_the_box() -> None:
    args = {"private_key": KEY, "public_key": PUB}
    [command], _ = plan(wireguard_key, args, {"found": {}})
    assert "wg genkey > /etc/wireguard/wg0.key.tmp" in command and "umask 077" in command
    assert "wg pubkey < /etc/wireguard/wg0.key > /etc/wireguard/wg0.pub.tmp" in command
    commands, noops = plan(wireguard_key, args, {"found": {KEY: REGULAR, PUB: REGULAR}})
    assert commands == [] and noops


def test_the_box_key_is_checked_against_the_inventory() -> None:
    args = {"public_key": PUB, "expected": KEY_A, "entry": "donor 'x'"}
    commands, noops = plan(tunnel_key_is, args, {"found": {PUB: [KEY_A]}})
    assert commands == [] and noops
    commands, _ = plan(tunnel_key_is, {**args, "expected": KEY_B}, {"found": {PUB: [KEY_A]}})
    assert f"its tunnel key is {KEY_A}, but the inventory" in refusal_message(commands)
    commands, _ = plan(tunnel_key_is, {**args, "expected": None, "entry": "edge 'e'"},
                       {"found": {PUB: [KEY_A]}})
    assert (f"its tunnel key is {KEY_A}: add `tunnel_public_key: {KEY_A}` to edge 'e'"
            in refusal_message(commands))
    commands, _ = plan(tunnel_key_is, args, {"found": {}})
    assert "no tunnel key on the box yet" in refusal_message(commands)


def test_wireguard_go_only_where_the_kernel_has_no_module() -> None:
    args = {"package": "wireguard-go"}
    assert plan(userspace_wireguard, args, {"kernel": True, "installed": set()})[0] == []
    assert plan(userspace_wireguard, args,
                {"kernel": False, "installed": {"wireguard-go"}})[0] == []
    [command], _ = plan(userspace_wireguard, args, {"kernel": False, "installed": set()})
    assert "apt_get_when_free 600 install -y -q wireguard-go" in command


def test_the_firewall_is_loaded_when_its_file_changed_or_the_table_is_gone() -> None:
    args = {"nft_file": "/etc/wireguard/wg0.nft", "table": "uncloseai_tunnel",
            "pending_marker": "/opt/uncloseai/state/tunnel.nft-pending"}
    assert plan(firewall_loaded, args, {"marker": {}, "loaded": True})[0] == []
    for marker, loaded in (({args["pending_marker"]: REGULAR}, True), ({}, False)):
        assert plan(firewall_loaded, args, {"marker": marker, "loaded": loaded})[0] == [
            "nft -f /etc/wireguard/wg0.nft && rm -f /opt/uncloseai/state/tunnel.nft-pending"]


def test_the_tunnel_watch_pings_each_edge_through_the_tunnel(tmp_path: Path) -> None:
    fleet, edges = load_inventory(donors_file(tmp_path))
    unit = tunnel_files.render_watch_unit(fleet["tb-home"].tunnel)
    assert (f'for edge in {edges["tb-edge"].tunnel_address}; do ping -n -q -c 1 -W 2 -I '
            'wg-uncloseai "$$edge"') in unit  # $$: systemd would expand $edge itself
    assert "BindsTo=wg-quick@wg-uncloseai.service" in unit and "DynamicUser=yes" in unit
    assert "sleep 5;" in unit
    # The edge answers those pings (and nothing else new) from the tunnel.
    assert 'iifname "wg-uncloseai" icmp type echo-request accept' in tunnel_files.render_nft(
        edges["tb-edge"].tunnel)


def test_a_changed_config_is_synced_never_restarted_and_keeps_the_key() -> None:
    args = {"unit": "wg-quick@wg0.service", "interface": "wg0", "private_key": KEY,
            "pending_marker": "/opt/uncloseai/state/tunnel.reload-pending"}
    running = {"UnitFileState": "enabled", "ActiveState": "active"}
    commands, noops = plan(tunnel_running, args, {"unit_state": running})
    assert commands == [] and noops
    [sync], _ = plan(tunnel_running, args, {"unit_state": {**running, "Present": "yes"}})
    assert "restart" not in sync and "wg syncconf wg0" in sync
    assert "getline k < keyfile" in sync and "-v keyfile=/etc/wireguard/wg0.key" in sync
    assert sync.endswith(" && rm -f /opt/uncloseai/state/tunnel.reload-pending")
    commands, _ = plan(tunnel_running, args, {"unit_state": {}})
    assert commands == ["systemctl enable -q wg-quick@wg0.service",
                        "systemctl restart wg-quick@wg0.service && rm -f "
                        "/opt/uncloseai/state/tunnel.reload-pending"]


@pytest.mark.skipif(not shutil.which("awk"), reason="awk")
def test_the_sync_puts_the_key_under_the_interface_section(tmp_path: Path) -> None:
    """sync_command's awk, run on a stripped config: the key from its file, after [Interface]."""
    from donorkit.box.tunnel_operations import sync_command

    key = tmp_path / "k"
    key.write_text(KEY_A + "\n")
    awk = sync_command("wg0", str(key)).split(" | ", 1)[1].split(" > ", 1)[0]
    stripped = "[Interface]\nListenPort = 51820\n\n[Peer]\nPublicKey = x\n"
    out = subprocess.run(["sh", "-c", awk], input=stripped, capture_output=True, text=True)
    assert out.stdout == ("[Interface]\nPrivateKey = " + KEY_A + "\nListenPort = 51820\n\n"
                          "[Peer]\nPublicKey = x\n"), out.stderr


PROXY_CASE = """
import http.server, os, ssl, sys, threading
from pathlib import Path
from donorkit.inventory.pki import Pki
from donorkit.commands.transport import https_get

tmp = Path(sys.argv[1])
pki = Pki(tmp / "pki")
cert, key = pki.server_cert("box", ["hermes.example.com"])
(tmp / "c.pem").write_text(cert)
(tmp / "k.pem").write_text(key)
(tmp / "ca.pem").write_text(pki.ca_pem())

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("x" * 200_000 + self.headers["Host"]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
server.socket = context.wrap_socket(server.socket, server_side=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
relay = [sys.executable, "-c", (
    "import os, socket, threading\\n"
    f"s = socket.create_connection(('127.0.0.1', {server.server_address[1]}))\\n"
    "def up():\\n    while (d := os.read(0, 65536)): s.sendall(d)\\n    s.shutdown(1)\\n"
    "threading.Thread(target=up, daemon=True).start()\\n"
    "while (d := s.recv(65536)):\\n    v = memoryview(d)\\n"
    "    while v: v = v[os.write(1, v):]\\n")]
status, body = https_get("203.0.113.1", 443, "hermes.example.com", "/v1/models",
                         tmp / "ca.pem", None, 20, proxy=relay)
print(status, len(body), body[-18:])
"""


def test_https_to_a_home_donor_goes_through_its_proxy_command(tmp_path: Path) -> None:
    """transport's PinnedHTTPS with `proxy` (a home donor's `ssh -W` through the edge): TLS
    with SNI and our CA over the command's stdin and stdout. Here the command is a relay to a
    local TLS server, and the address given is one nothing answers: only the relay reaches it.
    In a fresh interpreter, as `make status` runs it (tests before this one leave gevent's
    patches in this process)."""
    import sys

    result = subprocess.run([sys.executable, "-c", PROXY_CASE, str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "200 200018 hermes.example.com", result.stderr[-3000:]
