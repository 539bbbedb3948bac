"""The GPU-side Caddy: the live Caddyfile is the rendered one, it validates on the box, and its
adapted JSON proxies each hostname to its own model's loopback port with the seed's transport."""

from __future__ import annotations

import difflib
import json

import pytest
from boxcheck import loggers_for_host, missing, need_systemd, reverse_proxies, routes_for_host
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel
from donorkit.inventory.paths import pki_dir
from donorkit.inventory.values import duration_ns
from donorkit.render import templates as render

NS_PER_S = 10**9


def _caddy(host: Host) -> str:
    if not host.exists("caddy"):
        missing(host, "caddy is not installed")
    return "caddy"


def _caddyfile(host: Host) -> str:
    if not host.file(render.CADDYFILE).exists:
        missing(host, f"{render.CADDYFILE} does not exist")
    return render.CADDYFILE


def _as_caddy(host: Host, command: str) -> str:
    """Caddy's checks run as the caddy user: as root `validate` would create a root-owned access
    log (locking the service out) and would hide a key the service cannot read."""
    if host.run("getent passwd caddy").rc == 0:
        return f"runuser -u caddy -- {command}"
    return command


def _duration_s(value: object) -> float:
    """Caddy JSON durations are ns integers (or Go duration strings when written by hand)."""
    if isinstance(value, (int, float)):
        return value / NS_PER_S
    return duration_ns(str(value)) / NS_PER_S  # the one parser (donorkit/inventory/values.py)


def _adapted(host: Host) -> dict:
    cached = getattr(host, "_verify_caddy_json", None)
    if cached is None:
        command = _as_caddy(host, f"{_caddy(host)} adapt --config {_caddyfile(host)} "
                                  "--adapter caddyfile")
        result = host.run(command)
        if result.rc != 0:
            pytest.fail(f"caddy adapt failed: {result.stderr.strip()}", pytrace=False)
        cached = json.loads(result.stdout)
        host._verify_caddy_json = cached  # type: ignore[attr-defined]
    return cached


def test_caddyfile_is_rendered(host: Host, data: DonorBox) -> None:
    live = host.file(_caddyfile(host)).content_string
    want = render.render_caddyfile(data)
    diff = "".join(difflib.unified_diff(want.splitlines(True), live.splitlines(True),
                                        "rendered from the inventory", render.CADDYFILE))
    assert live == want, f"{render.CADDYFILE} differs from the render:\n{diff[:3000]}"


def test_caddy_validate(host: Host) -> None:
    command = _as_caddy(host, f"{_caddy(host)} validate --config {_caddyfile(host)} "
                              "--adapter caddyfile")
    result = host.run(command)
    assert result.rc == 0, f"`{command}` failed:\n{result.stderr.strip()[-2000:]}"


def test_proxy_transport(host: Host, data: DonorBox) -> None:
    """keepalive off (a pooled half-open connection drops a POST silently) and the timeouts."""
    proxies = reverse_proxies(_adapted(host))
    assert proxies, "the adapted config has no reverse_proxy"
    for proxy in proxies:
        transport = proxy.get("transport", {})
        where = f"reverse_proxy to {[u.get('dial') for u in proxy.get('upstreams', [])]}"
        assert transport.get("keep_alive", {}).get("enabled") is False, f"{where}: keep-alive on"
        assert "dial_timeout" in transport, f"{where}: no dial_timeout"
        assert _duration_s(transport["dial_timeout"]) == _duration_s(data.caddy_dial_timeout)
        assert "response_header_timeout" in transport, f"{where}: no response_header_timeout"
        assert _duration_s(transport["response_header_timeout"]) == _duration_s(
            data.caddy_response_header_timeout)


def test_route_upstream_is_its_model(host: Host, route: str, route_model: ServedModel) -> None:
    routes = routes_for_host(_adapted(host), route)
    assert routes, f"no site for {route} in the adapted config"
    dials = sorted({u.get("dial") for r in routes for p in reverse_proxies(r)
                    for u in p.get("upstreams", [])})
    assert dials == [f"127.0.0.1:{route_model.port}"], f"{route} proxies to {dials}"


def test_route_listens_on_public_port(host: Host, data: DonorBox, route: str) -> None:
    config = _adapted(host)
    servers = config.get("apps", {}).get("http", {}).get("servers", {}).values()
    listen = [a for s in servers if any(routes_for_host({"apps": {"http": {"servers": {"s": s}}}},
                                                        route)) for a in s.get("listen", [])]
    assert f":{data.caddy_https_port}" in listen, f"{route} is served on {listen}"


def test_access_log_scrubbed(host: Host, data: DonorBox, route: str) -> None:
    loggers = loggers_for_host(_adapted(host), route)
    assert loggers, f"{route} has no access log"
    for log in loggers:
        assert log.get("writer", {}).get("filename") == data.caddy_access_log, log
        fields = log.get("encoder", {}).get("fields", {})
        for header in data.caddy_log_scrubbed_headers:
            field = fields.get(f"request>headers>{header}", {})
            assert field.get("filter") == "delete", f"{route}: {header} is not deleted from logs"
        uri = fields.get("request>uri", {})
        assert (uri.get("filter"), uri.get("regexp"), uri.get("value")) == (
            "regexp", "=[^&]*", "=REDACTED"), f"{route}: query values are logged: {uri}"


def test_admin_api_on_a_socket_only_root_and_caddy_use(host: Host, data: DonorBox) -> None:
    """No TCP admin port a local user could load a config through; the socket's directory is
    caddy's, 0750; the service user cannot reach it; `systemctl reload caddy` goes through it."""
    socket = data.caddy_admin_socket
    assert _adapted(host).get("admin", {}).get("listen") == f"unix/{socket}"
    need_systemd(host, "Caddy's running admin socket")
    directory = host.file(socket.rsplit("/", 1)[0])
    if not directory.exists:
        missing(host, f"{directory.path} does not exist (caddy not running with the drop-in?)")
    assert (directory.user, directory.group, directory.mode) == ("caddy", "caddy", 0o750), (
        f"{directory.path} is {directory.user}:{directory.group} {oct(directory.mode)}")
    assert host.file(socket).is_socket, f"{socket} is not a socket"
    tcp = [line for line in host.check_output("ss -ltnpH").splitlines()
           if '"caddy"' in line and f":{data.caddy_https_port} " not in line]
    assert not tcp, f"caddy listens on more than its public port: {tcp}"
    user = data.service_user
    denied = host.run("runuser -u %s -- test -w %s", user, socket)
    assert denied.rc != 0, f"{user} can write to {socket}"
    reload = host.run("systemctl reload caddy")
    assert reload.rc == 0, f"systemctl reload caddy failed: {reload.stderr}"


def test_tls_certificate(host: Host, data: DonorBox) -> None:
    """The box's pair from our private CA (the edge verifies it), naming every routed hostname."""
    from cryptography import x509

    cert_path, key_path = render.tls_paths(data)
    for path in (cert_path, key_path):
        if not host.file(path).exists:
            missing(host, f"{path} does not exist")
    assert host.file(key_path).mode & 0o007 == 0, f"{key_path} is readable by others"
    cert = x509.load_pem_x509_certificate(host.file(cert_path).content)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sorted(sans.get_values_for_type(x509.DNSName))
    assert names == sorted(r.hostname for r in data.routes), f"certificate names {names}"
    ca_path = pki_dir(data) / "ca.crt"
    if not ca_path.is_file():
        pytest.skip(f"certificate names are right; no {ca_path} here to check who issued it")
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_path.read_bytes()))


def test_box_is_not_drained_from_the_edges(host: Host, data: DonorBox) -> None:
    """The rolling rollout's drain flag is gone (every successful deploy removes it): while it
    exists the box's Caddy fails every edge's health check, so no edge sends it traffic (a
    rollout that stopped at this box leaves it; `make rollout FROM=<box>` or a deploy of it
    clears it)."""
    flag = render.drain_flag(data)
    assert not host.file(flag).exists, (
        f"{flag} exists: the edges' health checks get 503 here, the box takes no traffic")
