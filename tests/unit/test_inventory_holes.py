"""Issue 21, holes 1 and 3: inventory values that wrote their own Caddy site, or handed the box
away, or locked the operator out, were accepted. Each is refused now with one line naming the
file, the host and the field (donorkit/inventory/schema.py), before anything renders or connects;
and the templates quote every value, so a value the schema let through still cannot open a site or a
directive (tests/unit/test_templates.py, tests/unit/test_inventory_property.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from donorkit.commands import rollout_plan
from donorkit.inventory import pki
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render.templates import render_edge_caddyfile
from tests.support.host_edit import put

BOX = {"ssh_host": "192.0.2.10", "ssh_user": "root", "card": "rtx4090",
       "routes": {"hermes.ai.unturf.com": "qwen"}}
EDGE = {"ssh_host": "192.0.2.2", "ssh_user": "admin", "hostnames": "all", "rate_limit": None}
# What the audit used: an IPv6 zone id (Python's ipaddress takes anything after `%`) holding a
# whole Caddy site that served the edge's client key.
ZONE_SITE = ("fe80::1%eth0]:443\n\t}\n}\nevil.example.com:80 {\n\tfile_server {\n"
             "\t\troot /etc/caddy/tls\n\t}\n}\nx.example.com {\n\treverse_proxy {\n#")


def write(tmp_path: Path, donors: dict | None = None, edges: dict | None = None,
          **overrides: object) -> Path:
    """A donors file (its PKI under tmp_path); `overrides` go to donor 'box'."""
    donors = donors or {"box": dict(BOX, overrides=overrides)}
    doc: dict = {"overrides": {"pki_dir": str(tmp_path / "pki")}, "donors": donors}
    if edges is not None:
        doc["edges"] = edges
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


def refused(path: Path, where: str, field: str, problem: str = "") -> str:
    with pytest.raises(FleetError) as caught:
        load_inventory(path)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: {where}: field '{field}'"), message
    assert problem in message, message
    return message


# ------------------------------------------------------------------ hole 1: one rule -----------

@pytest.mark.parametrize("address", [
    ZONE_SITE, "fe80::1%eth0", "fe80::1%a b", "fe80::1%{", "fe80::1%\n", "::1%lo"])
def test_ssh_host_takes_no_ipv6_zone_id(tmp_path: Path, address: str) -> None:
    refused(write(tmp_path, {"box": dict(BOX, ssh_host=address)}), "donor 'box'", "ssh_host")


def test_an_edges_ssh_host_takes_no_zone_id_either(tmp_path: Path) -> None:
    refused(write(tmp_path, edges={"front": dict(EDGE, ssh_host=ZONE_SITE)}), "edge 'front'",
            "ssh_host")


def test_the_audits_edge_site_never_reaches_a_caddyfile(tmp_path: Path) -> None:
    """The same zone id through the template (the schema bypassed): the render refuses it."""
    fleet, edges = load_inventory(write(tmp_path, edges={"front": EDGE}))
    data = edges["front"]
    data = put(data, ("sites", 0, "upstreams", 0, "address"), f"[{ZONE_SITE}]:443")
    with pytest.raises(ValueError, match="cannot be a Caddyfile token"):
        render_edge_caddyfile(data)


# Every string of the file, at any depth, keys too, donors and edges alike, goes through one rule:
# no control, format or line-separator characters, no backslash, no Caddy `{$ENV}`.
@pytest.mark.parametrize("where, place, field", [
    ("donor 'box'", {"overrides": {"cards": {"rtx4090": {"gpu_name": "NVIDIA\u2028}"}}}},
     "overrides.cards.rtx4090.gpu_name"),
    ("donor 'box'", {"overrides": {"unit_environment": {"X": "a\\"}}},
     "overrides.unit_environment.X"),
    ("donor 'box'", {"overrides": {"models": {"qwen": {"args": ["--x", "a\u202eb"]}}}},
     "overrides.models.qwen.args.1"),
    ("donor 'box'", {"overrides": {"acceptance": {"results_dir": "r\ne"}}},
     "overrides.acceptance.results_dir"),
    ("donor 'box'", {"overrides": {"cards": {"rtx3090": {"acceptance": {
        "baseline": {"source": "seed\n}"}}}}}},
     "overrides.cards.rtx3090.acceptance.baseline.source"),
    ("donor 'box'", {"overrides": {"unit_environment": {"X": "{$HOME}"}}},
     "overrides.unit_environment.X"),
    ("donor 'box'", {"overrides": {"unit_environment": {"X\u2029": "1"}}},
     "overrides.unit_environment.'X\\u2029'"),
])
def test_every_string_obeys_one_rule(tmp_path: Path, where: str, place: dict,
                                     field: str) -> None:
    refused(write(tmp_path, {"box": dict(BOX, **place)}), where, field)


def test_edge_strings_obey_it_too(tmp_path: Path) -> None:
    edge = dict(EDGE, overrides={"caddy_log_scrubbed_headers": ["Api-Key"],
                                 "acceptance": {"results_dir": "a\x1bb"}})
    refused(write(tmp_path, edges={"front": edge}), "edge 'front'",
            "overrides.acceptance.results_dir")


@pytest.mark.parametrize("checkpoint", ['/models/x"}', "/models/{x}", "/models/x\\",
                                        "/models/a b"])
def test_a_checkpoint_path_cannot_close_a_quoted_token(tmp_path: Path, checkpoint: str) -> None:
    refused(write(tmp_path, models={"qwen": {"checkpoint": checkpoint}}), "donor 'box'",
            "overrides.models.qwen.checkpoint")


# ------------------------------------------------------------------ hole 3: identities ---------

@pytest.mark.parametrize("user, problem", [("caddy", "caddy"), ("root", "root"),
                                           ("sshd", "system account")])
def test_service_user_is_nobody_elses(tmp_path: Path, user: str, problem: str) -> None:
    refused(write(tmp_path, service_user=user), "donor 'box'", "overrides.service_user", problem)


def test_service_user_is_not_the_login_user(tmp_path: Path) -> None:
    path = write(tmp_path, {"box": dict(BOX, ssh_user="fox")})
    refused(path, "donor 'box'", "service_user", "ssh_user")


@pytest.mark.parametrize("second, other", [
    ({"ssh_host": "192.0.2.10", "ssh_port": 2222}, "donor 'box'"),
    ({"ssh_host": "::ffff:192.0.2.10"}, "donor 'box'"),
])
def test_two_donors_on_one_box(tmp_path: Path, second: dict, other: str) -> None:
    donors = {"box": BOX, "box2": dict(BOX, **second)}
    refused(write(tmp_path, donors), "donor 'box2'", "ssh_host", other)


@pytest.mark.parametrize("donor_host, edge_host", [
    ("gpu1.lan", "GPU1.LAN."), ("2001:db8::7", "2001:0db8:0:0:0:0:0:7"),
    ("127.0.0.1", "localhost"), ("::1", "127.0.0.1"), ("::ffff:10.0.0.1", "10.0.0.1"),
    ("198.51.100.4", "198.51.100.4")])
def test_an_edge_on_a_donors_box(tmp_path: Path, donor_host: str, edge_host: str) -> None:
    path = write(tmp_path, {"box": dict(BOX, ssh_host=donor_host)},
                 {"front": dict(EDGE, ssh_host=edge_host, ssh_port=2200)})
    refused(path, "edge 'front'", "ssh_host", "donor 'box'")


@pytest.mark.parametrize("address", ["127.1", "0x7f.0.0.1", "2130706433", "0.0.0.0", "::"])
def test_other_spellings_of_an_address_are_refused(tmp_path: Path, address: str) -> None:
    refused(write(tmp_path, {"box": dict(BOX, ssh_host=address)}), "donor 'box'", "ssh_host")


@pytest.mark.parametrize("name", [pki.OPERATOR_CLIENT, "operator-x",
                                  *getattr(pki, "OPERATOR_CLIENT_NAMES", ())])
def test_an_edge_is_not_named_like_the_operators_certificate(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, edges={name: EDGE})
    with pytest.raises(FleetError, match=rf"^{path}: edge '{name}': name: the operator's own "
                                         "client certificates"):
        load_inventory(path)


# ------------------------------------------------------------------ hole 3: paths --------------

@pytest.mark.parametrize("overrides, field", [
    ({"caddy_admin_socket": "/run/sshd/admin.sock"}, "overrides.caddy_admin_socket"),
    ({"caddy_admin_socket": "/run/systemd/admin.sock"}, "overrides.caddy_admin_socket"),
    ({"caddy_access_log": "/etc/shadow"}, "overrides.caddy_access_log"),
    ({"caddy_access_log": "/var/log/caddy"}, "overrides.caddy_access_log"),
    ({"caddy_tls_dir": "/etc"}, "overrides.caddy_tls_dir"),
    ({"caddy_tls_dir": "/etc/caddy"}, "overrides.caddy_tls_dir"),
    ({"install_root": "/etc"}, "overrides.install_root"),
    ({"install_root": "/"}, "overrides.install_root"),
    ({"install_root": "/opt"}, "overrides.install_root"),
    ({"venv_dir": "/usr/lib/venv"}, "overrides.venv_dir"),
    ({"vllm_exl3_plugin_dir": "/etc/vllm-exl3"}, "overrides.vllm_exl3_plugin_dir"),
])
def test_paths_lie_under_their_services_root(tmp_path: Path, overrides: dict,
                                             field: str) -> None:
    refused(write(tmp_path, **overrides), "donor 'box'", field)


def test_an_edge_gets_the_same_path_rules(tmp_path: Path) -> None:
    edge = dict(EDGE, overrides={"caddy_access_log": "/etc/shadow"})
    refused(write(tmp_path, edges={"front": edge}), "edge 'front'", "overrides.caddy_access_log")


@pytest.mark.parametrize("value", ["~/.ssh/id_ed25519", "/root/.ssh/id_rsa", ".ssh/key"])
def test_hf_token_file_is_not_an_ssh_key_path(tmp_path: Path, value: str) -> None:
    refused(write(tmp_path, hf_token_file=value), "donor 'box'", "overrides.hf_token_file",
            "SSH")


@pytest.mark.parametrize("content", [
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n-----END OPENSSH PRIVATE KEY-----\n",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n", "PuTTY-User-Key-File-3: ssh-ed25519\n"])
def test_hf_token_file_is_not_a_private_key(tmp_path: Path, content: str) -> None:
    key = tmp_path / "token"
    key.write_text(content)
    refused(write(tmp_path, hf_token_file=str(key)), "donor 'box'", "overrides.hf_token_file",
            "private key")


def test_a_real_token_file_passes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("hf_abcdefghijklmnopqrstuvwxyz\n")
    fleet, _ = load_inventory(write(tmp_path, hf_token_file=str(token)))
    assert fleet["box"].hf_token_file == str(token)


# ------------------------------------------------------------------ hole 3: unit settings ------

@pytest.mark.parametrize("key, value", [
    ("ExecStartPost", "+/bin/sh -c id"), ("ExecStartPre", "!/bin/true"),
    ("ExecStartPre", "-+/usr/bin/nvidia-modprobe -u -c=0 -m"), ("ExecStopPost", "!!/bin/x"),
    ("SupplementaryGroups", "disk"), ("AmbientCapabilities", "CAP_SYS_ADMIN"),
    ("StandardOutput", "file:/etc/passwd"), ("LoadCredential", "x:/etc/shadow"),
    ("BindPaths", "/etc"), ("ReadWritePaths", "/etc {service_home}"),
    ("PermissionsStartOnly", "yes"), ("Group", "disk"), ("RootDirectory", "/"),
    ("RuntimeDirectory", "sshd"), ("OOMScoreAdjust", "-1000"), ("Nice", "-20"),
    ("ExecStartPost", "/bin/true ; +/bin/sh -c id"),
])
def test_unit_settings_that_grant_privilege(tmp_path: Path, key: str, value: str) -> None:
    message = refused(write(tmp_path, unit_service={key: value}), "donor 'box'",
                      f"overrides.unit_service.{key}")
    assert "unknown field" not in message, message


@pytest.mark.parametrize("key, value", [
    ("ExecStartPost", "/bin/true"), ("ExecStartPre", "-/usr/bin/nvidia-smi -L"),
    ("InaccessiblePaths", "-{service_home}/.config/uncloseai"), ("MemoryMax", "20G"),
    ("ReadWritePaths", "{service_home} {service_home}/x"), ("Nice", 5), ("PrivateTmp", True)])
def test_unit_settings_that_grant_nothing_pass(tmp_path: Path, key: str, value: object) -> None:
    fleet, _ = load_inventory(write(tmp_path, unit_service={key: value}))
    assert key in fleet["box"].unit_service


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT"])
def test_environment_for_the_dynamic_loader_is_refused(tmp_path: Path, name: str) -> None:
    """Environment= reaches the root-run `+` ExecStartPre too."""
    refused(write(tmp_path, unit_environment={name: "/home/fox/x.so"}), "donor 'box'",
            f"overrides.unit_environment.{name}")


# ------------------------------------------------------------------ hole 3: the edge -----------

@pytest.mark.parametrize("key", ["{http.request.header.X-Forwarded-For}", "{http.request.host}",
                                 "{http.request.uri}", "{http.request.remote}"])
def test_rate_limit_key_is_server_known(tmp_path: Path, key: str) -> None:
    edge = dict(EDGE, rate_limit={"events": 3, "window": "1s", "key": key})
    refused(write(tmp_path, edges={"front": edge}), "edge 'front'", "rate_limit.key",
            "chosen by the client")


@pytest.mark.parametrize("field, value", [("health_interval", "0s"), ("health_timeout", "0ms"),
                                          ("health_interval", "-1s"), ("health_interval", "1d"),
                                          ("health_interval", "25h"), ("health_interval", ".5s")])
def test_durations_the_rollout_cannot_wait_on(tmp_path: Path, field: str, value: str) -> None:
    refused(write(tmp_path, edges={"front": EDGE}, edge_proxy={field: value}), "donor 'box'",
            f"overrides.edge_proxy.{field}")


def test_one_duration_type_for_schema_template_and_rollout(tmp_path: Path) -> None:
    """`1m30s` is a Caddy duration: the schema takes it, the rollout waits 90 s plus the check's
    timeout, and the edge's Caddyfile says the same (it crashed the rollout after the drain)."""
    proxy = {"health_interval": "1m30s", "health_timeout": "1.5s"}
    _, edges = load_inventory(write(tmp_path, edges={
        "front": dict(EDGE, overrides={"edge_proxy": proxy})}))
    edge = rollout_plan.Edge("front", edges["front"])
    assert edge.health_wait == 91.5
    text = render_edge_caddyfile(edges["front"])
    assert "\t\t\thealth_interval 90s\n" in text and "\t\t\thealth_timeout 1500ms\n" in text


# ------------------------------------------------------------------ one line, exit 2 ----------

def test_make_render_says_one_line_and_touches_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, {"box": dict(BOX, ssh_host=ZONE_SITE)})
    result = subprocess.run([sys.executable, "-m", "donorkit.commands.render_cli", "box",
                             str(tmp_path / "out")], cwd=REPO_ROOT,
                            env=dict(os.environ, DONORS_FILE=str(path)), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"inventory error: {path}: donor 'box': field 'ssh_host': "), result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "pki").exists()
