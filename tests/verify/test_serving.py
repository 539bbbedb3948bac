"""Serving through the box's Caddy, once the model is ready (GET /health == 200). The donor's
Caddy answers only a client with an edge's certificate, and an edge's key never goes to a donor:
the request is made from this machine with an edge's client pair from pki_dir (mtls.py)."""

from __future__ import annotations

import json

import mtls
import pytest
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel


def _ready(host: Host, model: ServedModel) -> None:
    """vLLM opens its port before the model is loaded: ready means /health == 200. A model that
    is not ready fails the check with the reason (a deployed box serves its models)."""
    url = f"http://127.0.0.1:{model.port}/health"
    code = host.run("curl -s -o /dev/null -m 5 -w '%%{http_code}' %s", url).stdout.strip()
    if code != "200":
        pytest.fail(f"{model.name} is not serving: GET {url} answered {code or 'nothing'}",
                    pytrace=False)


def _trusted_client(data: DonorBox) -> tuple:
    """A client certificate the donor trusts: an edge's where the inventory has edges, else the
    operator's own (the only one a donor without edges trusts)."""
    return mtls.edge_client_pair(data) or mtls.operator_client_pair(data)


def _through_caddy(data: DonorBox, hostname: str, path: str, client: tuple) -> tuple[int, str]:
    """GET https://hostname:port/path at the box's address via its Caddy, verified against our
    CA, with `client`'s certificate."""
    try:
        return mtls.get(data.ssh_hostname, data.caddy_https_port, hostname, path,
                        mtls.ca_file(data), client, proxy=data.caddy_proxy_command)
    except OSError as exc:
        pytest.fail(f"GET {path} via {hostname} at {data.ssh_hostname}: {exc}",
                    pytrace=False)


def test_models_through_caddy(host: Host, data: DonorBox, route: str,
                              route_model: ServedModel) -> None:
    _ready(host, route_model)
    code, body = _through_caddy(data, route, "/v1/models", _trusted_client(data))
    assert code == 200, f"/v1/models via {route}: HTTP {code} {body[:200]}"
    listed = [(e.get("id"), e["max_model_len"]) for e in json.loads(body)["data"]]
    assert listed == [(route_model.checkpoint, route_model.max_model_len)], listed


def test_version_through_caddy(host: Host, data: DonorBox, route: str,
                               route_model: ServedModel) -> None:
    _ready(host, route_model)
    code, body = _through_caddy(data, route, "/version", _trusted_client(data))
    assert code == 200, f"/version via {route}: HTTP {code} {body[:200]}"


def test_metrics_through_caddy_for_the_operator_only(host: Host, data: DonorBox, route: str,
                                                    route_model: ServedModel) -> None:
    """vLLM's /metrics is the operator's (issue 21, hole 8): through the donor's Caddy an edge's
    client certificate gets Caddy's own 404 (empty body, vLLM never asked), the operator's own
    certificate gets the metrics."""
    _ready(host, route_model)
    edge = mtls.edge_client_pair(data)
    if edge is not None:  # a donor of an inventory without edges trusts no edge certificate
        code, body = _through_caddy(data, route, "/metrics", edge)
        assert (code, body) == (404, ""), f"/metrics via {route} with an edge's certificate: " \
            f"HTTP {code} {body[:200]}"
    code, body = _through_caddy(data, route, "/metrics", mtls.operator_client_pair(data))
    assert code == 200 and "vllm:" in body, f"/metrics via {route} with the operator's " \
        f"certificate: HTTP {code} {body[:200]}"
