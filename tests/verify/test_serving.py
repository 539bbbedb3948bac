"""Serving through Caddy on the box, once the model is ready (GET /health == 200)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from testinfra.host import Host

from donorkit.fleet import REPO_ROOT


def _ready(host: Host, model: dict) -> None:
    """vLLM opens its port before the model is loaded: ready means /health == 200."""
    url = f"http://127.0.0.1:{model['port']}/health"
    code = host.run("curl -s -o /dev/null -m 5 -w '%%{http_code}' %s", url).stdout.strip()
    if code != "200":
        pytest.skip(f"{model['name']} is not serving: GET {url} answered {code or 'nothing'}")


def _ca_pem(data: dict) -> str | None:
    ca = REPO_ROOT / data["pki_dir"] / "ca.crt"
    return ca.read_text() if Path(ca).is_file() else None


def _through_caddy(host: Host, data: dict, hostname: str, path: str) -> tuple[int, str]:
    """GET https://hostname:port/path on the box via its Caddy, verified against our CA."""
    port = data["caddy_https_port"]
    ca = _ca_pem(data)
    verify = "-k"  # no CA on this machine: the certificate is checked by test_tls_certificate
    if ca:
        verify = '--cacert "$ca"'
    script = (f"ca=$(mktemp); trap 'rm -f \"$ca\"' EXIT; printf '%s' {shlex.quote(ca or '')} "
              f"> \"$ca\"; curl -sS -m 60 -w '\\n%{{http_code}}' {verify} "
              f"--resolve {hostname}:{port}:127.0.0.1 https://{hostname}:{port}{path}")
    result = host.run("/bin/sh -c %s", script)
    assert result.rc == 0, f"curl {path} via Caddy failed: {result.stderr.strip()}"
    body, _, code = result.stdout.rpartition("\n")
    return int(code), body


def test_models_through_caddy(host: Host, data: dict, route: str, route_model: dict) -> None:
    _ready(host, route_model)
    code, body = _through_caddy(host, data, route, "/v1/models")
    assert code == 200, f"/v1/models via {route}: HTTP {code} {body[:200]}"
    listed = [(e.get("id"), e.get("max_model_len")) for e in json.loads(body)["data"]]
    assert listed == [(route_model["checkpoint"], route_model["max_model_len"])], listed


def test_version_through_caddy(host: Host, data: dict, route: str, route_model: dict) -> None:
    _ready(host, route_model)
    code, body = _through_caddy(host, data, route, "/version")
    assert code == 200, f"/version via {route}: HTTP {code} {body[:200]}"
