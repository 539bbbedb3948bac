"""What a rendered Caddyfile and unit must be, whatever the values in them: read back by the real
`caddy adapt`, the config has exactly the sites, listeners, upstreams and files the host's data
names, and every site has the template's shape (no extra site, directive or matcher); a unit has
exactly the template's lines. Shared by tests/unit/test_templates.py (values put straight into
the host data, the schema bypassed) and tests/unit/test_inventory_property.py (values through the
inventory)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from donorkit.inventory.host_data import DonorBox, EdgeBox, ServedModel
from donorkit.render.templates import CADDYFILE, render_host, unit_environment

VENV_CADDY = str(Path(sys.executable).parent / "caddy")


def in_tmp(data: DonorBox | EdgeBox, tmp: Path) -> DonorBox | EdgeBox:
    """The host's data with its TLS directory, access log and PKI under tmp (the same strings
    behind a prefix: `caddy adapt` reads the certificates the config names)."""
    return data.model_copy(update={"caddy_tls_dir": f"{tmp}{data.caddy_tls_dir}",
                                   "caddy_access_log": f"{tmp}{data.caddy_access_log}",
                                   "pki_dir": str(tmp / "pki")})


def lay_out(data: DonorBox | EdgeBox, tmp: Path) -> tuple[Path, dict[str, str]]:
    """Every rendered file written (those under tmp where they are, the rest under tmp/root);
    returns the Caddyfile's path and {unit path: text}."""
    units = {}
    for item in render_host(data):
        target = (Path(item.path) if item.path.startswith(str(tmp))
                  else tmp / "root" / item.path.lstrip("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(item.content)
        if item.path.endswith(".service"):
            units[item.path] = item.content
    return tmp / "root" / CADDYFILE.lstrip("/"), units


class CaddyRefused(Exception):
    """`caddy adapt` did not read the Caddyfile (so neither would the deploy's validate)."""


def adapt(caddyfile: Path, binary: str = VENV_CADDY) -> dict:
    result = subprocess.run([binary, "adapt", "--adapter", "caddyfile", "--config",
                             str(caddyfile)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise CaddyRefused(result.stderr + caddyfile.read_text())
    return json.loads(result.stdout)


# Keys whose children are named by data (zones by hostname); elsewhere a key that is not plain
# lowercase (srv0, log0, header names, log field paths, hostnames) is data too.
_DATA_PARENTS = {"zones"}


def skeleton(node: Any, parent: str = "") -> Any:
    """The shape of adapted JSON: Caddy's own keys and handler names kept, data as a marker,
    and repeated items as a set (a pool of three donors has the shape of a pool of one)."""
    if isinstance(node, dict):
        items = set()
        for key, value in node.items():
            plain = parent not in _DATA_PARENTS and re.fullmatch(r"[a-z_]+", key)
            items.add((key if plain else "*", skeleton(value, key)))
        return ("dict", frozenset(items))
    if isinstance(node, list):
        return ("list", frozenset(skeleton(value, parent) for value in node))
    if isinstance(node, str):
        return node if parent == "handler" else "str"
    return type(node).__name__


def _routes(config: dict) -> list[dict]:
    return [route for server in config["apps"]["http"]["servers"].values()
            for route in [*server.get("routes", []), *server.get("errors", {}).get("routes", [])]]


def _find(node: Any, key: str) -> list[Any]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                found.append(v)
            found += _find(v, key)
    elif isinstance(node, list):
        for v in node:
            found += _find(v, key)
    return found


def _without_sites(config: dict) -> dict:
    """The config with each server's routes and errors left out (compared site by site)."""
    servers = {name: {k: v for k, v in server.items() if k not in ("routes", "errors")}
               for name, server in config["apps"]["http"]["servers"].items()}
    return dict(config, apps=dict(config["apps"], http=dict(config["apps"]["http"],
                                                           servers=servers)))


def check_caddy(data: DonorBox | EdgeBox, config: dict, reference: dict) -> None:
    """`config` (adapted from data's Caddyfile) has the sites, listeners, upstreams and files
    data names, and the shape of `reference` (the same template, rendered from shipped data)."""
    edge = isinstance(data, EdgeBox)
    hostnames = ({site.hostname for site in data.sites} if edge
                 else {route.hostname for route in data.routes})
    port = data.edge_https_port if edge else data.caddy_https_port
    assert config["admin"] == {"listen": f"unix/{data.caddy_admin_socket}"}, config["admin"]
    servers = config["apps"]["http"]["servers"].values()
    assert {a for server in servers for a in server["listen"]} == {f":{port}"}
    routes = _routes(config)
    hosts = [h for route in routes for match in route.get("match", []) for h in match["host"]]
    assert set(hosts) == hostnames, (hosts, hostnames)
    assert all(len(route.get("match", [])) == 1 for route in routes), routes
    if edge:
        wanted = {u.address.removeprefix("https://") for site in data.sites
                  for u in site.upstreams}
    else:
        wanted = {f"127.0.0.1:{data.models[r.model].port}" for r in data.routes}
    dials = {u["dial"] for u in _find(routes, "upstreams") for u in u}
    assert dials and dials <= wanted, (dials, wanted)
    logs = [log for name, log in config["logging"]["logs"].items() if name != "default"]
    assert {log["writer"]["filename"] for log in logs} == {data.caddy_access_log}
    files = {v for loaded in _find(config.get("apps", {}).get("tls", {}), "load_files")
             for f in loaded for v in (f["certificate"], f["key"])}
    assert all(f.startswith(f"{data.caddy_tls_dir}/") for f in files), files
    assert skeleton(_without_sites(config)) == skeleton(_without_sites(reference))
    assert {skeleton(route) for route in routes} == {skeleton(r) for r in _routes(reference)}


def unit_keys(text: str) -> list[str]:
    """The unit's settings as systemd reads them: `[Section]Key` per setting, in order, after
    continuation lines are joined and comments dropped."""
    keys, section, pending = [], "", None
    for raw in text.split("\n"):
        if pending is None and (not raw.strip() or raw.lstrip()[:1] in ("#", ";")):
            continue
        line = raw if pending is None else pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = None
        if line.startswith("["):
            section = line
            keys.append(section)
        else:
            keys.append(section + line.split("=", 1)[0])
    assert pending is None, text
    return keys


def check_unit(data: DonorBox, model: ServedModel, text: str) -> None:
    wanted = ["[Unit]", "[Unit]Description", "[Unit]Wants", "[Unit]After", "[Service]",
              "[Service]Type", "[Service]User",
              *["[Service]Environment"] * len(unit_environment(data, model)),
              "[Service]ExecStart", *[f"[Service]{k}" for k in data.unit_service],
              "[Install]", "[Install]WantedBy"]
    assert unit_keys(text) == wanted, text
    assert f"\nUser={data.service_user}\n" in text


def check_host(data: DonorBox | EdgeBox, tmp: Path, reference: dict,
               same_as: str | None = None) -> None:
    """Render the host as the deploy would, then check its Caddyfile (read by `caddy adapt`
    unless it is `same_as`, the reference's text) and its units."""
    caddyfile, units = lay_out(data, tmp)
    check_caddy(data, reference if caddyfile.read_text() == same_as else adapt(caddyfile),
                reference)
    if isinstance(data, DonorBox):
        for model in data.models.values():
            check_unit(data, model, units[f"/etc/systemd/system/{model.unit}"])


def reference_config(data: DonorBox | EdgeBox, tmp: Path) -> dict:
    caddyfile, _ = lay_out(in_tmp(data, tmp), tmp)
    return adapt(caddyfile)

