"""A home donor behind NAT (issue 23), end to end on the testbed: tb-home sits in its own network
behind a router namespace that masquerades it (outbound only: nothing on the test network, this
machine and tb-edge included, has a route to it). The operator deploys tb-edge (its first deploy
prints its new tunnel key, pasted into the donors file), writes tb-home's join file (signed with
the CA key; it prints the CA's fingerprint); the owner runs `make join ... FINGERPRINT=...` at
tb-home's console (pyinfra's @local connector: the tunnel only; a wrong fingerprint, a tampered
file and an own config under the tunnel's name refused first) and sends the printed keys; the
operator pastes them, deploys the edge (the peer is added), then deploys tb-home through the
edge (SSH -W over the tunnel) with the same entry point as any donor. Then: it serves through
the edge (a request loop with 0 failures), a second run changes nothing, `make accept` measures
it on its own Caddy through the edge's SSH, `make verify` passes its tunnel checks, the firewall
lets only the edge's tunnel address in, the tunnel is cut on the edge's side and tb-home is back
in the pool by itself (the time it took), and tb-never (in the donors file, never joined) gets
no traffic. Everything real: wireguard-go (this kernel has no WireGuard module), wg-quick under
systemd, nftables, sshd, Caddy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from donorkit.commands.transport import wait_until
from donorkit.inventory.fleet import load_inventory
from donorkit.inventory.host_data import DonorBox, EdgeBox
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import OPERATOR_CLIENT, ca_fingerprint
from tests.support import hosts as bed
from tests.support.common import make_accept
from tests.support.deploy import Deployed, operations, run_deploy
from tests.support.hosts import Host, on_console, ssh

BIN = Path(sys.executable).parent
SOURCE = REPO_ROOT / "tests/testbed/donors-tunnel.yml"
# The operator's donors file for this run: keys are pasted into it as the operator does.
DONORS = REPO_ROOT / ".testbed/donors-tunnel.yml"
JOIN = REPO_ROOT / ".testbed/join-tb-home.yml"
EDGE, HOME, NEVER = "tb-edge", "tb-home", "tb-never"
# tb-home's address in this list is its router's on the test network (hosts.up's `nat`).
HOSTS = [(EDGE, "10.213.0.20"), (HOME, "10.213.0.30")]
PKI = REPO_ROOT / ".testbed/pki"
HOSTNAME = "hermes.ai.unturf.com"
IFACE = "wg-uncloseai"
LOG = "/var/log/caddy/access.log"
# Where the owner keeps the checkout on the box.
CHECKOUT = "/root/donorkit"
TIMES: dict[str, float] = {}
FIGURES: dict[str, object] = {}


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, Host]]:
    DONORS.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, DONORS)
    JOIN.unlink(missing_ok=True)
    with bed.testbed(HOSTS, times=TIMES, nat=[HOME], tun=[EDGE, HOME]) as started:
        yield {h.name: h for h in started}
    print("\ntunnel testbed phase times: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))
    print("tunnel figures: " + json.dumps(FIGURES))


def inventory() -> tuple[dict[str, DonorBox], dict[str, EdgeBox]]:
    return load_inventory(DONORS)


def paste(kind: str, name: str, field: str, value: str) -> None:
    """The operator edits the donors file (one field of one entry)."""
    doc = yaml.safe_load(DONORS.read_text())
    doc[kind][name][field] = value
    DONORS.write_text(yaml.safe_dump(doc, sort_keys=False))


def deploy(*limit: str, want_json: bool = False, timeout: float = 1800) -> Deployed:
    """The real entry point with the operator's donors file: (rc, --json results, output,
    seconds)."""
    return run_deploy(*[arg for name in limit for arg in ("--limit", name)], donors=DONORS,
                      json_report=want_json, timeout=timeout)


def changed_ops(report: dict, host: str) -> list[str]:
    return operations(report, host, "success")


def sshd_answers_here(address: str) -> str:
    """ssh-keyscan of `address`:22 from this machine (empty when no sshd answered). Connecting
    alone proves nothing here: this machine's way out accepts any TCP connection."""
    return subprocess.run(["ssh-keyscan", "-T", "4", address], capture_output=True,
                          text=True).stdout


def via_edge(hosts: dict[str, Host], path: str = "/v1/models", tag: str = "") -> tuple[int, str]:
    """A public client's request to the edge's address with the public hostname."""
    header = f"-H 'X-Loop: {tag}' " if tag else ""
    result = subprocess.run(
        ["sh", "-c", f"curl -sS -m 20 -o /dev/stdout -w '\\n%{{http_code}}' {header}"
                     f"--cacert {PKI}/ca.crt --resolve {HOSTNAME}:443:{hosts[EDGE].ip} "
                     f"https://{HOSTNAME}{path}"], capture_output=True, text=True, timeout=30)
    body, _, code = result.stdout.rpartition("\n")
    return int(code or 0), body


def handshake_age(hosts: dict[str, Host], key: str) -> float | None:
    """Seconds since the edge's last handshake with the peer of `key` (None: never)."""
    out = ssh(hosts[EDGE], f"wg show {IFACE} latest-handshakes", check=False).stdout
    for line in out.splitlines():
        peer, _, at = line.partition("\t")
        if peer == key and at.strip() not in ("", "0"):
            return time.time() - int(at)
    return None


def test_the_home_box_has_no_way_in(hosts: dict[str, Host]) -> None:
    """tb-home reaches the test network (outbound, masqueraded), but neither this machine nor
    the edge reaches it: no route, no port forward. (Proven before anything is installed.)"""
    home = hosts[HOME]
    assert home.ip.startswith("192.168.77."), home
    out = on_console(home, "curl -sS -o /dev/null -w '%{http_code}' http://10.213.0.1:8089/",
                     check=False)
    assert out.stdout.strip() in ("200", "404"), (out.stdout, out.stderr)
    host_key = on_console(home, "cut -d' ' -f2 /etc/ssh/ssh_host_ed25519_key.pub").stdout.strip()
    assert host_key
    assert host_key not in sshd_answers_here(home.ip)
    from_edge = ssh(hosts[EDGE], f"ssh-keyscan -T 4 {home.ip} 2>/dev/null", check=False).stdout
    assert host_key not in from_edge
    # ... while the same check sees the edge's sshd (the check itself works).
    edge_key = ssh(hosts[EDGE], "cut -d' ' -f2 /etc/ssh/ssh_host_ed25519_key.pub").stdout.strip()
    assert edge_key and edge_key in sshd_answers_here(hosts[EDGE].ip)


def test_edge_first_deploy_prints_its_tunnel_key(hosts: dict[str, Host]) -> None:
    """The edge makes its own key pair; with no key in the donors file yet its deploy stops at
    the check, saying the key and the line to paste; pasted, the next deploy brings the hub up
    (no peer yet: nobody has joined), listening on UDP 51820 only."""
    rc, _, output, _ = deploy(EDGE)
    assert rc != 0, output[-3000:]
    found = re.search(r"refused: tb-edge: its tunnel key is (\S{44}): add `tunnel_public_key: "
                      r"\1` to edge 'tb-edge'", output)
    assert found, output[-3000:]
    key = found.group(1)
    assert key == ssh(hosts[EDGE], f"cat /etc/wireguard/{IFACE}.pub").stdout.strip()
    assert ssh(hosts[EDGE], f"stat -c %a /etc/wireguard/{IFACE}.key").stdout.strip() == "600"
    paste("edges", EDGE, "tunnel_public_key", key)
    rc, _, output, _ = deploy(EDGE)
    assert rc == 0, output[-4000:]
    show = ssh(hosts[EDGE], f"wg show {IFACE}").stdout
    assert "listening port: 51820" in show and "peer:" not in show, show
    assert ssh(hosts[EDGE], f"systemctl is-active wg-quick@{IFACE}").stdout.strip() == "active"
    # wireguard-go, not a kernel module (this kernel has none).
    assert ssh(hosts[EDGE], "pgrep -x wireguard-go", check=False).returncode == 0


def test_the_owner_joins_with_one_command(hosts: dict[str, Host]) -> None:
    """The operator writes the join file (nothing secret in it, signed with the CA key) and
    gets the CA's fingerprint; the owner, at the box, with this checkout, runs `make join
    JOIN=... FINGERPRINT=...`: a wrong fingerprint, a tampered file and a WireGuard config of
    the owner's own under the tunnel's name are refused, changing nothing; then the tunnel comes
    up from the box (pyinfra @local) and the box's public keys are printed; the operator pastes
    them and deploys the edge; the first handshake follows. The join time is measured from
    `make join` to that handshake."""
    home = hosts[HOME]
    result = subprocess.run(["make", "-s", "join-file", f"HOST={HOME}", f"OUT={JOIN}"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, DONORS_FILE=str(DONORS)))
    assert result.returncode == 0, result.stdout + result.stderr
    printed = re.search(r"FINGERPRINT=([0-9a-f]{64})", result.stdout)
    assert printed, result.stdout
    fingerprint = printed.group(1)
    assert fingerprint == ca_fingerprint((PKI / "ca.crt").read_text())
    join = yaml.safe_load(JOIN.read_text())
    assert join["tunnel"]["peers"][0]["public_key"] == inventory()[1][EDGE].tunnel_public_key
    assert "PRIVATE" not in JOIN.read_text().upper()
    # The owner's copy of the toolkit (git clone in real life) and the join file, on the box.
    root = bed.containers.host_dir(HOME) / "root"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        source = REPO_ROOT / name
        if source.is_file():
            target = root / CHECKOUT.lstrip("/") / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    shutil.copy2(JOIN, root / CHECKOUT.lstrip("/") / JOIN.name)
    started = time.monotonic()
    prepared = on_console(home, "apt-get -q update >/dev/null && apt-get install -y -q make "
                          f">/dev/null && cd {CHECKOUT} && make -s venv >/dev/null",
                          check=False, timeout=900)
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    TIMES["owner's checkout venv"] = time.monotonic() - started
    refused_joins(home, fingerprint)
    started = time.monotonic()
    joined = on_console(home, f"cd {CHECKOUT} && make -s join JOIN={JOIN.name} "
                        f"FINGERPRINT={fingerprint}", check=False, timeout=900)
    join_run = time.monotonic() - started
    TIMES["make join on the box"] = join_run
    assert joined.returncode == 0, joined.stdout[-4000:] + joined.stderr[-3000:]
    key = re.search(r"^tunnel_public_key: (\S{44})$", joined.stdout, re.M)
    host_key = re.search(r"^known_hosts: (\S+ \S+ \S+)$", joined.stdout, re.M)
    assert key and host_key, joined.stdout[-3000:]
    # The private key stays on the box: root-only, never printed.
    private = on_console(home, f"cat /etc/wireguard/{IFACE}.key").stdout.strip()
    assert private and private not in joined.stdout + joined.stderr
    assert on_console(home, f"stat -c %a /etc/wireguard/{IFACE}.key").stdout.strip() == "600"
    # The operator pastes what the owner sent, and deploys the edge: the peer is added.
    paste("donors", HOME, "tunnel_public_key", key.group(1))
    with bed.KNOWN_HOSTS.open("a") as handle:
        handle.write(host_key.group(1) + "\n")
    started = time.monotonic()
    rc, _, output, _ = deploy(EDGE)
    assert rc == 0, output[-4000:]
    edge_run = time.monotonic() - started
    why = wait_until(lambda: None if handshake_age(hosts, key.group(1)) is not None else
                     "no handshake yet", 120, 0.5)
    assert why is None, ssh(hosts[EDGE], f"wg show {IFACE}").stdout
    handshake = time.monotonic() - started - edge_run
    FIGURES["join"] = {"make_join_s": round(join_run, 1), "edge_deploy_s": round(edge_run, 1),
                       "handshake_after_edge_deploy_s": round(handshake, 1),
                       "total_s": round(join_run + edge_run + handshake, 1)}
    print(f"\njoin: make join {join_run:.1f} s, the edge's deploy {edge_run:.1f} s, first "
          f"handshake {handshake:.1f} s after it")


def refused_joins(home: Host, fingerprint: str) -> None:
    """What `make join` refuses on the box, each in one line and with nothing changed there (no
    key made, no interface, no package installed): a fingerprint not the operator's, a file
    changed after signing, and (the file good) a WireGuard config of the owner's own under the
    tunnel's name, which is left as it was."""
    conf = f"/etc/wireguard/{IFACE}.conf"
    tampered = yaml.safe_load(JOIN.read_text())
    tampered["tunnel"]["peers"][0]["endpoint"] = "203.0.113.66:51820"
    (bed.containers.host_dir(HOME) / "root" / CHECKOUT.lstrip("/") / "tampered.yml").write_text(
        yaml.safe_dump(tampered))
    owners = "[Interface]\nPrivateKey = b3duZXJzLW93bi1rZXktbm90LW91cnMtMDAwMDAwMDA=\n"
    installed = on_console(home, "dpkg -s wireguard-tools", check=False).returncode
    for join, given, expected, setup in (
            (JOIN.name, "0" * 64, "not the operator's", ""),
            ("tampered.yml", fingerprint, "it was changed after the operator signed it", ""),
            (JOIN.name, fingerprint, "exists and is not the uncloseai deploy's",
             f"mkdir -p -m 700 /etc/wireguard && printf %s {shlex.quote(owners)} > {conf} && ")):
        result = on_console(home, f"{setup}cd {CHECKOUT} && make -s join JOIN={join} "
                            f"FINGERPRINT={given}", check=False, timeout=600)
        assert result.returncode != 0, result.stdout[-2000:]
        assert expected in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr
        left = on_console(home, f"ls /etc/wireguard/{IFACE}.key /sys/class/net/{IFACE}",
                          check=False)
        assert left.returncode != 0 and not left.stdout.strip(), left.stdout
        if setup:
            assert on_console(home, f"cat {conf}").stdout == owners
            on_console(home, f"rm {conf} && rmdir /etc/wireguard 2>/dev/null || true")
    assert on_console(home, "dpkg -s wireguard-tools", check=False).returncode == installed


def test_the_operator_deploys_it_through_the_edge(hosts: dict[str, Host]) -> None:
    """The same entry point as any donor, over SSH through the edge to its tunnel address: it
    converges (the whole stack, stand-ins for the GPU); a second run, with the edge, changes
    nothing. A volunteer's box (issue 32): no cache builder's wheel is shipped to it (this
    inventory names none, so a wheel the fleet's scenarios left in the cache is not used): it
    builds its own, and what it built is not copied back to the operator's caches."""
    cache = REPO_ROOT / ".testbed/wheel-cache"
    rc, report, output, took = deploy(HOME, timeout=2400, want_json=True)
    assert rc == 0, output[-6000:]
    TIMES["deploy through the edge"] = took
    ops = changed_ops(report, HOME)
    assert "exllamav3: upload the cached wheel of this stack" not in ops, ops
    assert "exllamav3: copy the wheel built here back to the cache" not in ops, ops
    assert not [p for p in cache.rglob("built-by") if p.read_text().strip() == HOME]
    assert not [p for p in cache.rglob("*.download")]
    rc, report, output, took = deploy(HOME, EDGE, want_json=True)
    assert rc == 0, output[-4000:]
    assert changed_ops(report, HOME) == [] and changed_ops(report, EDGE) == [], (
        changed_ops(report, HOME), changed_ops(report, EDGE))
    TIMES["no-op re-run, donor and edge"] = took


def test_caddy_listens_on_the_tunnel_and_loopback_only(hosts: dict[str, Host]) -> None:
    home = hosts[HOME]
    tunnel = inventory()[0][HOME].tunnel_address
    listening = on_console(home, "ss -Htlnp | grep caddy").stdout
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines()}
    assert addresses == {tunnel, "127.0.0.1"}, listening


def test_it_serves_through_the_edge_and_the_never_joined_gets_nothing(
        hosts: dict[str, Host]) -> None:
    """A request loop through the edge (50 ms apart): 0 failed, every one answered by tb-home
    (its access log); the edge sees tb-never (in its pool, never joined: no peer) down and
    tb-home up (`make status`, through SSH to the edge)."""
    tag = f"tunnel-{int(time.time())}"
    codes = []
    started = time.monotonic()
    for seq in range(100):
        codes.append(via_edge(hosts, tag=f"{tag}-{seq}")[0])
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    failed = sum(code != 200 for code in codes)
    logged = on_console(hosts[HOME], f"grep -cF {shlex.quote(tag)} /var/log/caddy/access.log",
                        check=False).stdout.strip()
    FIGURES["request_loop"] = {"requests": len(codes), "failed": failed,
                               "answered_by_tb_home": int(logged or 0),
                               "seconds": round(elapsed, 1)}
    print(f"\nrequest loop through the edge: {len(codes)} requests, {failed} failed, "
          f"{logged} in tb-home's log, {elapsed:.1f} s")
    assert failed == 0, codes
    assert int(logged) == len(codes)
    # `make status` on the home box (SSH and its Caddy through the edge) and the edge.
    result = subprocess.run([str(BIN / "python"), "-m", "donorkit.commands.status", "--json",
                             "--limit", f"{HOME},{EDGE}"], cwd=REPO_ROOT, capture_output=True,
                            text=True,
                            timeout=120, env=dict(os.environ, DONORS_FILE=str(DONORS)))
    doc = json.loads(result.stdout)
    rows = {row["name"]: row for row in doc["hosts"]}
    pool = {row["donor"]: row["seen"] for row in rows[EDGE]["pool"]}
    assert pool == {HOME: "up", NEVER: "down"}, result.stdout
    [model] = rows[HOME]["models"]
    assert model["ready"] and model["state"] == "active/running", rows[HOME]
    assert rows[HOME]["toolkit"] and not rows[HOME].get("unreachable"), rows[HOME]


def chat_requests(log: str) -> list[dict]:
    """The OpenAI client's chat completions in a Caddy access log (its JSON lines)."""
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e["request"] for e in entries if e["request"]["uri"] == "/v1/chat/completions"
            and e["request"]["headers"].get("User-Agent", [""])[0].startswith("AsyncOpenAI")]


def test_accept_measures_it_on_its_caddy_through_the_edges_ssh(hosts: dict[str, Host]) -> None:
    """`make accept LIMIT=tb-home`: tb-edge spreads the hostname over tb-home and tb-never, so
    tb-home is measured on its own Caddy, at its tunnel address, which only the edge reaches:
    through one SSH forward through tb-edge for the whole run, with the operator's client
    certificate. The record names that way and has every figure (the stand-in's chat); tb-home's
    Caddy logged the run's chat requests, each from the edge's tunnel address; tb-edge's Caddy
    logged none (they did not go through its public site)."""
    fleet, edges = inventory()
    tunnel, edge_tunnel = fleet[HOME].tunnel_address, edges[EDGE].tunnel_address
    started = time.monotonic()
    record, _ = make_accept(HOME, {"DONORS_FILE": str(DONORS)}, timeout=600)
    TIMES["make accept through the edge's SSH"] = time.monotonic() - started
    assert (record.donor, record.via) == (HOME, f"https://{tunnel}:443")
    assert record.route.startswith(
        f"to the donor's Caddy at {tunnel}:443 through edge {EDGE}'s SSH forward, with client "
        f"certificate {OPERATOR_CLIENT} (edge {EDGE} spreads it over 2 donors"), record.route
    res = record.results["qwen"]
    assert res.error is None and res.checks["models"].ok and res.checks["version"].ok, res
    assert res.details["version"]["version"] == "0.26.0-standin"
    for figure in ("ttft_s", "decode_tok_s", "prefill_tok_s", "concurrent_wall_s"):
        assert res.figures[figure] and res.figures[figure] > 0, (figure, res.figures)
    FIGURES["accept"] = {name: round(value, 3) for name, value in res.figures.items()
                         if value is not None}
    # chat, two to size the prompts, prefill, the concurrent ones: on tb-home, from the edge.
    chats = chat_requests(on_console(hosts[HOME], f"sleep 0.5; cat {LOG}").stdout)
    assert len(chats) == 4 + record.workload.concurrent_prompts, len(chats)
    assert {chat["remote_ip"] for chat in chats} == {edge_tunnel}, chats[0]
    assert chat_requests(ssh(hosts[EDGE], f"cat {LOG}").stdout) == []


def test_verify_checks_the_tunnel(hosts: dict[str, Host], tmp_path: Path) -> None:
    """`make verify`'s tunnel cases on tb-home (through the edge) and tb-edge: the tunnel up,
    its last handshake recent, Caddy on no public interface."""
    report = tmp_path / "verify.xml"
    result = subprocess.run(
        [str(BIN / "pytest"), "-q", "-p", "no:cacheprovider", "tests/verify/test_tunnel.py",
         "--limit", f"{HOME},{EDGE}", f"--junitxml={report}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, DONORS_FILE=str(DONORS)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "5 passed" in output, output[-2000:]


def test_only_the_edge_reaches_the_box_through_the_tunnel(hosts: dict[str, Host]) -> None:
    """nftables on tb-home: from the edge's tunnel address its Caddy answers; from another
    address on the edge's side of the tunnel (a second address on the edge's interface, let
    through by tb-home's WireGuard once its allowed IPs and routes are widened: a misconfigured
    box) the connection is dropped by the firewall; and the edge forwards nothing between
    tunnel peers."""
    edge, home = hosts[EDGE], hosts[HOME]
    fleet, edges = inventory()
    target = fleet[HOME].tunnel_address
    # As the edge's Caddy asks: SNI and Host the public name, our CA, the edge's client pair.
    tls = "/etc/caddy/tls"
    ask = (f"curl -sS -o /dev/null -w '%{{http_code}}' --connect-timeout 4 -m 10 "
           f"--cacert {tls}/ca.crt --cert {tls}/{EDGE}-client.crt --key {tls}/{EDGE}-client.key "
           f"--resolve {HOSTNAME}:443:{target} https://{HOSTNAME}/v1/models")
    ok = ssh(edge, ask, check=False)
    assert ok.stdout.strip() == "200", ok
    rogue = "10.77.255.254"
    edge_key = edges[EDGE].tunnel_public_key
    # tb-home's WireGuard misconfigured with a wider AllowedIPs (and its route, as wg-quick
    # would add it): only its firewall stands between that address and its Caddy now.
    on_console(home, f"wg set {IFACE} peer {edge_key} allowed-ips "
                     f"{edges[EDGE].tunnel_address}/32,{rogue}/32 && "
                     f"ip route add {rogue}/32 dev {IFACE}")
    ssh(edge, f"ip addr add {rogue}/32 dev {IFACE}")
    try:
        out = ssh(edge, f"{ask} --interface {rogue}", check=False)
        # curl's 28: the connection timed out (dropped), not refused or answered.
        assert out.returncode == 28 and out.stdout.strip() == "000", out
        counters = on_console(home, "nft list chain inet uncloseai_tunnel input").stdout
        assert re.search(r'iifname "wg-uncloseai" drop', counters), counters
    finally:
        ssh(edge, f"ip addr del {rogue}/32 dev {IFACE}", check=False)
        on_console(home, f"ip route del {rogue}/32 dev {IFACE}; wg set {IFACE} peer {edge_key} "
                         f"allowed-ips {edges[EDGE].tunnel_address}/32", check=False)
    assert ssh(edge, ask, check=False).stdout.strip() == "200"
    forward = ssh(edge, "nft list chain inet uncloseai_tunnel forward").stdout
    assert f'iifname "{IFACE}" drop' in forward and f'oifname "{IFACE}" drop' in forward


def test_a_cut_tunnel_comes_back_by_itself(hosts: dict[str, Host]) -> None:
    """The tunnel cut on the edge's side (wg-quick down, then up: its sessions are gone; the
    donor behind NAT is the only side that can dial): requests through the edge fail while it is
    down, and tb-home is back in the pool by itself, with nothing done on the box. The time from
    the tunnel's return to the first request answered again is the recovery time."""
    edge = hosts[EDGE]
    assert via_edge(hosts)[0] == 200
    ssh(edge, f"systemctl stop wg-quick@{IFACE}")
    down_codes = [via_edge(hosts)[0] for _ in range(3)]
    assert all(code != 200 for code in down_codes), down_codes
    ssh(edge, f"systemctl start wg-quick@{IFACE}")
    back = time.monotonic()
    requests, failed = 0, 0
    while True:
        code = via_edge(hosts)[0]
        requests += 1
        if code == 200:
            break
        failed += 1
        assert time.monotonic() - back < 300, "tb-home did not come back within 300 s"
        time.sleep(0.5)
    recovery = time.monotonic() - back
    FIGURES["tunnel_cut"] = {"recovery_s": round(recovery, 1), "requests_until_back": requests,
                             "failed_while_recovering": failed}
    print(f"\ntunnel cut on the edge's side: tb-home back in the pool {recovery:.1f} s after "
          f"the tunnel came back ({failed} requests failed meanwhile)")
    codes = [via_edge(hosts)[0] for _ in range(20)]
    assert codes == [200] * 20, codes
