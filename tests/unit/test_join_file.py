"""Issue 32, hole 3: the join file a home donor's owner runs as root (`make join`) is checked as
strictly as the inventory, only ever adds our own tunnel, and is refused unless the operator's
CA signed it (its fingerprint given to the owner apart from the file). Each bad file below is
signed with the operator's real CA key where the check under test is not the signature's (a
file the CA signed is still refused when it asks for more than a tunnel); each refusal is one
line naming the file and the field, through the same entry point `make join` runs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from donorkit.box.tunnel_operations import CONF_MARKER, TunnelOwnership, tunnel_is_ours
from donorkit.commands import join_file as tunnel_join
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import Pki, ca_fingerprint
from donorkit.render import tunnel_files
from pyinfra_declared.json_cases import plan, refusal_message
from tests.support.make import make
from tests.unit.test_tunnel import donors_file


@pytest.fixture
def joined(tmp_path: Path):
    """tb-home's join file as `make join-file` writes it, and the operator's CA fingerprint."""
    fleet, _ = load_inventory(donors_file(tmp_path))
    out = tmp_path / "join-tb-home.yml"
    assert tunnel_join.write_join_file("tb-home", fleet, out) == ""
    return out, ca_fingerprint(Pki(tmp_path / "pki").ca_pem())


def sign(doc: dict, pki: Pki) -> dict:
    """`doc` signed by `pki`'s CA over its data as it stands (what holding that key allows)."""
    body = json.dumps({"donor": doc["donor"], "tunnel": doc["tunnel"]}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True).encode()
    ca, signature = pki.sign(tunnel_join.SIGNED_PREFIX + body)
    return {**doc, "signature": {"ca": base64.b64encode(ca).decode(),
                                 "value": base64.b64encode(signature).decode()}}


def refused(path: Path, fingerprint: str) -> str:
    with pytest.raises(FleetError) as caught:
        tunnel_join.read_join_file(path, fingerprint)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


def test_the_good_join_file_is_accepted_and_adds_only_our_tunnel(joined) -> None:
    path, fingerprint = joined
    text = path.read_text()
    assert "PRIVATE" not in text.upper() and "packages" not in text
    join = tunnel_join.read_join_file(path, fingerprint)
    # The fingerprint as openssl prints it works too.
    openssl = ":".join(fingerprint[i:i + 2] for i in range(0, 64, 2)).upper()
    assert tunnel_join.read_join_file(path, f"sha256:{openssl}") == join
    assert join.tunnel.peers[0].endpoint == "10.213.0.20:51820"
    settings = tunnel_join.local_tunnel_settings()
    data = tunnel_join.donor_tunnel(join, settings)
    assert data.packages == settings.packages  # the owner's checkout's, never the file's
    conf = tunnel_files.render_conf(data)
    assert conf.startswith(CONF_MARKER)  # what the ownership check looks for
    assert [line for line in conf.splitlines() if line.startswith("AllowedIPs")] == [
        f"AllowedIPs = {join.tunnel.peers[0].address}/32"]
    assert "tcp dport { 443, 22 }" in tunnel_files.render_nft(data)
    assert "TCP 443 (Caddy) and 22 (sshd) open to those tunnel addresses only" in \
        tunnel_join.summary(join, settings)


BAD = [
    # (what it tries, change to the data, expected in the line)
    ("a package list", lambda d: d["tunnel"].update(packages=["evil-rootkit"]),
     "field 'tunnel.packages': unknown field"),
    ("the old free port list", lambda d: d["tunnel"].update(allowed_ports=[443, 22, 5432]),
     "field 'tunnel.allowed_ports': unknown field"),
    ("a third port", lambda d: d["tunnel"]["ports"].update(postgres=5432),
     "field 'tunnel.ports.postgres': unknown field"),
    ("a port out of range", lambda d: d["tunnel"]["ports"].update(ssh=0),
     "field 'tunnel.ports.ssh'"),
    ("one port for both", lambda d: d["tunnel"]["ports"].update(ssh=443),
     "field 'tunnel.ports.ssh': 443 is also the Caddy port"),
    ("a peer of 1.1.1.1", lambda d: d["tunnel"]["peers"][0].update(address="1.1.1.1"),
     "field 'tunnel.peers.0.address': 1.1.1.1 is not inside the tunnel pool 10.77.0.0/16"),
    ("a peer of 1.1.1.1/32", lambda d: d["tunnel"]["peers"][0].update(address="1.1.1.1/32"),
     "field 'tunnel.peers.0.address': '1.1.1.1/32'"),
    ("a second peer routing 1.1.1.1",
     lambda d: d["tunnel"]["peers"].append({**d["tunnel"]["peers"][0], "name": "evil",
                                            "address": "1.1.1.1"}),
     "field 'tunnel.peers.1.address': 1.1.1.1 is not inside the tunnel pool"),
    ("a public pool", lambda d: d["tunnel"].update(pool="1.1.1.0/24"),
     "field 'tunnel.pool': '1.1.1.0/24'"),
    ("a loopback pool",
     lambda d: d["tunnel"].update(pool="127.0.0.0/8", address="127.0.0.2") or
     d["tunnel"]["peers"][0].update(address="127.0.0.1"),
     "field 'tunnel.pool'"),  # the inventory's pool rule may say it first
    ("a link-local pool (the metadata address)",
     lambda d: d["tunnel"].update(pool="169.254.169.0/24", address="169.254.169.2") or
     d["tunnel"]["peers"][0].update(address="169.254.169.254"),
     "field 'tunnel.pool'"),
    ("the box's own address as a peer's",
     lambda d: d["tunnel"]["peers"][0].update(address=d["tunnel"]["address"]),
     "field 'tunnel.peers.0.address'"),
    ("the pool's broadcast address", lambda d: d["tunnel"].update(address="10.77.255.255"),
     "field 'tunnel.address': 10.77.255.255 is the pool's broadcast address"),
    ("a shell in the endpoint",
     lambda d: d["tunnel"]["peers"][0].update(endpoint="10.213.0.20:51820; rm -rf /"),
     "field 'tunnel.peers.0.endpoint'"),
    ("interface lo", lambda d: d["tunnel"].update(interface="lo"),
     "field 'tunnel.interface': 'lo' is the box's loopback interface"),
    ("interface ..", lambda d: d["tunnel"].update(interface=".."),
     "field 'tunnel.interface': '..'"),
    ("interface .", lambda d: d["tunnel"].update(interface="."),
     "field 'tunnel.interface': '.'"),
    ("interface too long", lambda d: d["tunnel"].update(interface="a" * 16),
     "field 'tunnel.interface'"),
    ("interface ../x", lambda d: d["tunnel"].update(interface="../x"),
     "field 'tunnel.interface'"),
    ("too many peers",
     lambda d: d["tunnel"].update(peers=[dict(d["tunnel"]["peers"][0], name=f"e{i}")
                                         for i in range(17)]),
     "field 'tunnel.peers': list should have at most 16 items"),
    ("a control character", lambda d: d["tunnel"]["peers"][0].update(name="edge\x1b[2J"),
     "field 'tunnel.peers.0.name': control character"),
    ("an unknown top-level field", lambda d: d.update(run="curl x | sh"),
     "field 'run': unknown field"),
]


@pytest.mark.parametrize(("what", "change", "expected"), BAD, ids=[b[0] for b in BAD])
def test_a_signed_join_file_that_asks_for_more_than_a_tunnel_is_refused(
        joined, tmp_path, what, change, expected) -> None:
    path, fingerprint = joined
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(sign(doc, Pki(tmp_path / "pki"))))
    message = refused(path, fingerprint)
    assert f"{path}: donor '" in message or f"{path}: field" in message, message
    assert expected in message, message


def test_the_signature_tells_the_operators_file(joined, tmp_path) -> None:
    path, fingerprint = joined
    good = yaml.safe_load(path.read_text())
    # Tampered: a value changed after signing (a valid one: only the signature can tell).
    doc = yaml.safe_load(path.read_text())
    doc["tunnel"]["peers"][0]["endpoint"] = "203.0.113.66:51820"
    path.write_text(yaml.safe_dump(doc))
    assert "field 'signature.value': does not match the file's contents" in \
        refused(path, fingerprint)
    # Re-signed by someone else's CA (the attacker's own): the fingerprint tells.
    path.write_text(yaml.safe_dump(sign(doc, Pki(tmp_path / "other-ca"))))
    message = refused(path, fingerprint)
    assert f"not the operator's {fingerprint} (FINGERPRINT)" in message, message
    # The operator's file, but the owner was given another fingerprint.
    path.write_text(yaml.safe_dump(good))
    other = ca_fingerprint(Pki(tmp_path / "other-ca").ca_pem())
    assert "field 'signature.ca': signed by the CA with fingerprint" in refused(path, other)
    assert "not a SHA-256 fingerprint" in refused(path, "")
    assert "not a SHA-256 fingerprint" in refused(path, fingerprint[:-1])
    # Unsigned.
    path.write_text(yaml.safe_dump({k: v for k, v in good.items() if k != "signature"}))
    assert "not signed (no field 'signature')" in refused(path, fingerprint)
    # A signature that is not base64, a certificate that is not one.
    path.write_text(yaml.safe_dump({**good, "signature": {**good["signature"], "value": "@@"}}))
    assert "field 'signature.value': not base64" in refused(path, fingerprint)


@pytest.mark.parametrize(("what", "text", "expected"), [
    ("alias bomb", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}]\n" for i in range(12)) + "donor: x\n",
     "more than 0 aliases (& and *) for a join file"),
    ("deep nesting, flow", "donor: x\ntunnel: " + "[" * 5000 + "]" * 5000 + "\n",
     "(line 2, column 14): nested deeper than 6 levels (a join file never is)"),
    ("deep nesting, block", "donor: x\n" + "".join(f"{' ' * i}k{i}:\n" for i in range(100))
     + " " * 100 + "v\n", "nested deeper than 6 levels"),
    ("too large", "donor: x\n#" + "x" * 20000 + "\n",
     "more than 16384 bytes: larger than a join file may be"),
    ("duplicate keys", "donor: x\ndonor: y\n", "duplicate key 'donor'"),
    ("not YAML", "donor: [x\n", "malformed YAML"),
    ("a 13th month", "donor: 2026-13-01\n", "cannot be read"),
    ("a list as a key", "? [a]\n: x\n", "malformed YAML"),
    ("not a mapping", "- x\n", "must be a mapping (donor, tunnel, signature), got list"),
    ("not text", "\udcff", "not UTF-8 text"),
])
def test_the_file_is_read_bounded_through_make_joins_entry_point(
        joined, what, text, expected) -> None:
    """`python -m donorkit.commands.join_file check` (the first step of `make join`): one line,
    exit 2, quickly (an alias bomb or a deep file is refused before it is built)."""
    path, fingerprint = joined
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    result = subprocess.run([sys.executable, "-m", "donorkit.commands.join_file", "check",
                             str(path), "--fingerprint", fingerprint], capture_output=True,
                            text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"join error: {path}: ") and expected in line, line


def test_make_join_file_signs_and_make_join_checks_it(tmp_path: Path) -> None:
    """The two commands as the operator and the owner run them: the first prints the CA's
    fingerprint, the second takes it and says what joining does; without it, `make join`
    stops at its usage line."""
    donors = donors_file(tmp_path)
    out = tmp_path / "join-tb-home.yml"
    env = dict(os.environ, DONORS_FILE=str(donors))
    wrote = subprocess.run(make("join-file", "HOST=tb-home", f"OUT={out}"), capture_output=True,
                           text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert wrote.returncode == 0, wrote.stdout + wrote.stderr
    fingerprint = ca_fingerprint(Pki(tmp_path / "pki").ca_pem())
    assert f"FINGERPRINT={fingerprint}" in wrote.stdout
    checked = subprocess.run([sys.executable, "-m", "donorkit.commands.join_file", "check",
                              str(out), "--fingerprint", fingerprint], capture_output=True,
                             text=True, timeout=60, cwd=REPO_ROOT)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("join: donor tb-home, signed by the operator's CA")
    usage = subprocess.run(make("join", f"JOIN={out}"), capture_output=True, text=True,
                           timeout=120, cwd=REPO_ROOT)
    assert usage.returncode == 2 and "FINGERPRINT=" in usage.stderr, usage.stderr


# ------------------------------------------------------------------ never the owner's tunnel --

CONF, IFACE = "/etc/wireguard/wg0.conf", "wg0"


@pytest.mark.parametrize(("found", "expected"), [
    ({"conf": "theirs", "interface": "yes"},
     "/etc/wireguard/wg0.conf exists and is not the uncloseai deploy's"),
    ({"conf": "theirs", "interface": "no"},
     "/etc/wireguard/wg0.conf exists and is not the uncloseai deploy's"),
    ({"conf": "absent", "interface": "yes"},
     "a network interface named wg0 exists on this box and is not the uncloseai tunnel's"),
])
def test_an_owners_own_wireguard_is_never_replaced(found, expected) -> None:
    commands, _ = plan(tunnel_is_ours, {"conf": CONF, "interface": IFACE}, {"found": found})
    assert expected in refusal_message(commands)


@pytest.mark.parametrize("found", [{"conf": "absent", "interface": "no"},
                                   {"conf": "ours", "interface": "yes"},
                                   {"conf": "ours", "interface": "no"}])
def test_our_own_tunnel_or_none_goes_on(found) -> None:
    commands, noops = plan(tunnel_is_ours, {"conf": CONF, "interface": IFACE}, {"found": found})
    assert commands == [] and noops


def test_the_ownership_fact_in_a_real_shell(joined, tmp_path) -> None:
    """The fact's own command on real files: the owner's config (with their private key) is
    theirs, and its contents never come back; ours is ours; a link or a folder is theirs."""
    path, fingerprint = joined
    data = tunnel_join.donor_tunnel(tunnel_join.read_join_file(path, fingerprint),
                                    tunnel_join.local_tunnel_settings())
    owners = tmp_path / "wg0.conf"
    owners.write_text("[Interface]\nPrivateKey = c2VjcmV0LW9mLXRoZS1vd25lcg==\n")
    ours = tmp_path / "ours.conf"
    ours.write_text(tunnel_files.render_conf(data))
    link = tmp_path / "link.conf"
    link.symlink_to(ours)
    fact = TunnelOwnership()
    cases = [(owners, "nope0", "theirs", "no"), (ours, "lo", "ours", "yes"),
             (link, "nope0", "theirs", "no"), (tmp_path, "nope0", "theirs", "no"),
             (tmp_path / "absent.conf", "..", "absent", "yes")]
    for conf, interface, state, exists in cases:
        out = subprocess.run(["sh", "-c", fact.command(str(conf), interface)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert "c2VjcmV0" not in out
        assert fact.process(out.splitlines()) == {"conf": state, "interface": exists}, conf
