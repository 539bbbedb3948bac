"""Load and validate the fleet (donors.yml + defaults.yml) into per-host pyinfra data.

What each key may hold is donorkit/schema.py. Every user mistake becomes one FleetError naming the
file, the entry and the field, raised before any connection is made.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from donorkit import pki, schema, tunnel, values
from donorkit.host_data import CudaHostCard, host_card
from donorkit.host_software import RequirementsFileError, driver_minimum, venv_install
from donorkit.paths import REPO_ROOT, repo_path
from donorkit.pki import OPERATOR_CLIENT

DEFAULTS_FILE = REPO_ROOT / "inventory" / "defaults.yml"
DONORS_FILE = REPO_ROOT / "inventory" / "donors.yml"


class FleetError(Exception):
    """A mistake in the inventory data; the message names file, entry and field."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


class _FastUniqueKeyLoader(getattr(yaml, "CSafeLoader", _UniqueKeyLoader)):  # type: ignore[misc]
    """The same on libyaml's parser where PyYAML has it: ~10x faster on defaults.yml, read on
    every run. Same documents accepted and refused; its messages are terser, so a refused file
    is parsed again by _UniqueKeyLoader for the message."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


for _loader in (_UniqueKeyLoader, _FastUniqueKeyLoader):
    _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            _construct_unique_mapping)


def read_yaml(path: Path) -> Any:
    """Parse one YAML file, turning every read/parse problem into a FleetError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise FleetError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_FastUniqueKeyLoader)
    except yaml.YAMLError:
        pass
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise FleetError(f"{path}: malformed YAML{where}: {problem}") from None


def plugin_local_path(source: dict) -> Path:
    """The plugin's directory on the operator's machine (relative paths: from the repo root)."""
    return repo_path(source["path"])


_EXPECTED = {"int_type": "int", "string_type": "str", "bool_type": "bool", "list_type": "list",
             "dict_type": "mapping", "float_type": "number", "model_type": "mapping",
             "model_attributes_type": "mapping", "literal_error": None}


_UNION_BRANCHES = {"PluginPath", "PluginGit", "str", "int", "float", "bool"}


def label(name: Any) -> str:
    """A key as it may appear in a one-line message: unusual ones (control characters, empty,
    not a string) as Python writes them."""
    text = str(name)
    if isinstance(name, str) and text and text.isprintable() and "'" not in text:
        return text
    return repr(name)


def _field(loc: tuple) -> str:
    """pydantic's location -> `models.qwen.port` (a union's branch names dropped)."""
    parts = []
    for item in loc:
        if item == "[key]":
            continue
        if item in _UNION_BRANCHES or str(item).startswith(("function-", "lax-", "literal[",
                                                              "list[", "engine=")):
            continue
        parts.append(label(item))
    return ".".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem(error: dict, model: type[BaseModel]) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        if "unit_service" in error["loc"]:
            return ("not a setting unit_service may hold (its allow-list: UnitService in "
                    "donorkit/unit_settings.py)")
        engine = next((str(i)[7:] for i in error["loc"] if str(i).startswith("engine=")), None)
        if engine:
            return f"not a field of a card profile with engine {engine}"
        return "unknown field"
    if kind == "value_error":
        return error["msg"].removeprefix("Value error, ")
    if kind in _EXPECTED and _EXPECTED[kind]:
        if "[key]" in error["loc"]:
            return f"key {_short(value)}: must be {_EXPECTED[kind]}"
        return f"must be {_EXPECTED[kind]}, got {type(value).__name__} {_short(value)}"
    message = error["msg"]
    return f"{message[:1].lower()}{message[1:]}, got {_short(value)}"


def _validate(model: type[BaseModel], data: Any, where: str, prefix: str = "",
              known: dict | None = None) -> Any:
    """model.model_validate(data), or a FleetError for the first problem, in one line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A misspelt key shows as "unknown" and its right spelling as "missing": name the first.
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        error = errors[0]
        field = _field(error["loc"])
        problem = _problem(error, model)
        if error["type"] == "extra_forbidden" and known is not None and "." not in field:
            problem += f" (known: {', '.join(sorted(known))})"
        raise FleetError(f"{where}: field '{prefix}{field}': {problem}") from None


def _check_strings(doc: Any, path: Path) -> None:
    """values.check_strings on a whole file: one line naming the file, the host and the field."""
    found = values.check_strings(doc)
    if not found:
        return
    where, problem = found
    if len(where) >= 2 and where[0] in ("donors", "edges"):
        host = f"{'donor' if where[0] == 'donors' else 'edge'} '{label(where[1])}'"
        if len(where) == 2:
            raise FleetError(f"{path}: {host}: name: {problem}")
        raise FleetError(f"{path}: {host}: field '{_field(where[2:])}': {problem}")
    raise FleetError(f"{path}: field '{_field(where)}': {problem}")


# What gives a private key away, in the first bytes of a file (PEM, OpenSSH, PuTTY).
_PRIVATE_KEY_MARKS = ("PRIVATE KEY-----", "PuTTY-User-Key-File", "OPENSSH PRIVATE KEY")


def token_file_problem(value: str | None) -> str | None:
    """hf_token_file is uploaded to every donor: never a file under an .ssh directory, never a
    file that holds a private key (a file not there yet is the weights step's to report)."""
    if not value:
        return None
    resolved = repo_path(value)
    if ".ssh" in Path(value).parts or ".ssh" in resolved.parts:
        return (f"{value} is under an .ssh directory: SSH keys are never uploaded (the token "
                "file goes to every donor)")
    try:
        with resolved.open("rb") as handle:
            head = handle.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    if any(mark in head for mark in _PRIVATE_KEY_MARKS):
        return f"{value} holds a private key, not a Hugging Face token"
    return None


def _merged(defaults: dict, override: Any, where: str, origin: str) -> dict:
    """defaults deep-merged with one `overrides:` mapping, validated as defaults.yml."""
    if not isinstance(override, dict):
        raise FleetError(f"{where}: field '{origin}': must be a mapping, "
                         f"got {type(override).__name__} {_short(override)}")
    for key in override:
        if key not in schema.Defaults.model_fields:
            raise FleetError(f"{where}: field '{origin}.{label(key)}': not a key of defaults.yml")
    merged = schema.deep_merge(defaults, override)
    # defaults.yml was valid alone: whatever is wrong now came with this override.
    _validate(schema.Defaults, merged, where, f"{origin}.")
    return merged


def _host_data(name: str, donor: schema.Donor, merged: dict, settings: schema.Defaults,
               where: str) -> dict:
    """Everything the tasks and templates need for one host, derived once, here."""
    problem = schema.check_box(settings, donor)
    if problem:
        raise FleetError(f"{where}: field '{problem[0]}': {problem[1]}")
    data = {k: v for k, v in merged.items() if k not in ("cards", "models")}
    models = merged["models"]
    card = host_card(donor.card, settings.cards[donor.card])
    served = sorted(set(donor.routes.values()))
    cuda = card.cuda if isinstance(card, CudaHostCard) else None
    data.update(
        donor_name=name,
        role="donor",
        card=card,
        cuda_version=cuda,
        **driver_minimum(merged["cuda_driver_minimums"], cuda,
                         card.vllm_variant if isinstance(card, CudaHostCard) else None),
        cuda_home=f"/usr/local/cuda-{cuda}" if cuda else None,
        cuda_package=f"cuda-toolkit-{cuda.replace('.', '-')}" if cuda else None,
        service_home=f"/home/{settings.service_user}",
        routes=[{"hostname": h, "model": m} for h, m in sorted(donor.routes.items())],
        models={m: dict(models[m], args=[str(a) for a in models[m]["args"]], name=m,
                        unit=f"vllm-{m}.service") for m in served},
        # Units of the identities this box does not serve: removed, so a switch frees the GPU.
        retired_units=[f"vllm-{m}.service" for m in sorted(models) if m not in served],
    )
    data["vllm_executable"] = data["vllm_executable"].replace("{venv_dir}", data["venv_dir"])
    try:
        data.update(venv_install(data))
    except RequirementsFileError as exc:
        raise FleetError(f"{where}: field 'cards.{card.name}.requirements_file': {exc}") from None
    # [Service] values may name the service user's home (ReadWritePaths=, BindPaths=).
    data["unit_service"] = {
        k: v.replace("{service_home}", data["service_home"]) if isinstance(v, str) else v
        for k, v in data["unit_service"].items()}
    data.update(_ssh_data(donor))
    return data


def _reach(name: str, donor: schema.Donor, merged: dict) -> dict:
    """How a donor is reached (donorkit/tunnel.py plans the rest): a tunnelled one at its
    tunnel address, which is also its identity among the boxes."""
    data = {"reach": donor.reach, "tunnel_address": donor.tunnel_address,
            "tunnel_public_key": donor.tunnel_public_key, "tunnel_settings": merged["tunnel"]}
    if donor.reach == "tunnel":
        data["ssh_hostname"] = (donor.tunnel_address
                                or tunnel.derived_address(merged["tunnel"]["pool"], name))
    return data


def load_fleet(donors_path: Path | str | None = None, defaults_path: Path | str | None = None,
               require_local_sources: bool = False) -> dict[str, dict]:
    """Return {donor name: host data}; raise FleetError on any mistake in either file."""
    return load_inventory(donors_path, defaults_path, require_local_sources)[0]


def _ssh_data(entry: schema.Donor | schema.Edge) -> dict:
    data: dict = {"ssh_hostname": entry.ssh_host, "ssh_user": entry.ssh_user,
                  "ssh_port": entry.ssh_port}
    for field in ("ssh_key", "ssh_known_hosts_file"):
        value = getattr(entry, field)
        if value is not None:  # relative paths are relative to the repo root, like everything else
            data[field] = str(repo_path(value))
    if entry.ssh_user != "root":
        data["_sudo"] = True
    return data


def _pools(donors: dict[str, dict], donors_path: Path) -> dict[str, dict]:
    """{public hostname: {model, checkpoint, donors: [names]}} from every donor's routes. One
    hostname is one model: every donor routing it must serve the same checkpoint (the edge's
    health check and the users' `model` field name it)."""
    pools: dict[str, dict] = {}
    for name, data in donors.items():
        for route in data["routes"]:
            model = data["models"][route["model"]]
            pool = pools.setdefault(route["hostname"], {"checkpoint": model["checkpoint"],
                                                        "model": route["model"],
                                                        "donors": [], "first": name})
            if model["checkpoint"] != pool["checkpoint"]:
                raise FleetError(
                    f"{donors_path}: donor '{name}': field 'routes.{route['hostname']}': serves "
                    f"{model['checkpoint']}, but donor '{pool['first']}' serves "
                    f"{pool['checkpoint']} under that hostname (one hostname, one checkpoint)")
            pool["donors"].append(name)
    return pools


def _edge_data(name: str, edge: schema.Edge, merged: dict, donors: dict[str, dict],
               pools: dict[str, dict], where: str) -> dict:
    """An edge's host data: its settings and one site per public hostname with its donors."""
    if edge.hostnames == "all":
        hostnames = sorted(pools)
    else:
        hostnames = sorted(set(edge.hostnames))
        for hostname in hostnames:
            if hostname not in pools:
                raise FleetError(f"{where}: field 'hostnames': no donor routes {hostname} "
                                 f"(routed: {', '.join(sorted(pools))})")
    keep = ("install_root", "apt_lock_wait", "caddy_upstream_repo_url", "caddy_upstream_key_url",
            "caddy_admin_socket", "caddy_dial_timeout", "caddy_response_header_timeout",
            "caddy_log_scrubbed_headers", "caddy_access_log", "caddy_tls_dir", "pki_dir",
            "pki_renew_days", "edge_https_port", "edge_proxy")
    data = {key: merged[key] for key in keep}
    sites = []
    for hostname in hostnames:
        pool = pools[hostname]
        upstreams = []
        for donor in pool["donors"]:
            address = donors[donor]["ssh_hostname"]
            address = f"[{address}]" if ":" in address else address
            upstreams.append({"donor": donor,
                              "address": f"{address}:{donors[donor]['caddy_https_port']}"})
        sites.append({"hostname": hostname, "model": pool["model"],
                      "checkpoint": pool["checkpoint"], "upstreams": upstreams,
                      "zone": hostname.replace(".", "_").replace("-", "_")})
    rate_limit = (edge.rate_limit if "rate_limit" in edge.model_fields_set
                  else merged["edge_rate_limit"])
    if isinstance(rate_limit, schema.RateLimit):
        rate_limit = rate_limit.model_dump()
    data.update(
        _ssh_data(edge),
        role="edge",
        edge_name=name,
        caddy_source=edge.caddy_source or merged["caddy_source"],
        public_tls=edge.public_tls or merged["edge_public_tls"],
        rate_limit=rate_limit,
        sites=sites,
    )
    return data


def load_inventory(donors_path: Path | str | None = None,
                   defaults_path: Path | str | None = None,
                   require_local_sources: bool = False) -> tuple[dict[str, dict], dict[str, dict]]:
    """Return ({donor name: host data}, {edge name: host data}); raise FleetError on any
    mistake in either file."""
    donors_path = Path(donors_path or os.environ.get("DONORS_FILE") or DONORS_FILE)
    defaults_path = Path(defaults_path or DEFAULTS_FILE)
    defaults = read_yaml(defaults_path)
    if not isinstance(defaults, dict):
        raise FleetError(f"{defaults_path}: must be a mapping of settings, "
                         f"got {type(defaults).__name__}")
    _check_strings(defaults, defaults_path)
    settings = _validate(schema.Defaults, defaults, str(defaults_path),
                         known=schema.Defaults.model_fields)
    problem = schema.check_driver_minimums(settings, list(settings.cards))
    if problem:
        raise FleetError(f"{defaults_path}: field '{problem[0]}': {problem[1]}")
    doc = read_yaml(donors_path)
    if not isinstance(doc, dict) or not isinstance(doc.get("donors"), dict) or not doc["donors"]:
        raise FleetError(f"{donors_path}: must be a mapping with a non-empty 'donors' mapping")
    _check_strings(doc, donors_path)
    inventory = _validate(schema.Inventory, doc, str(donors_path),
                          known=schema.Inventory.model_fields)
    file_wide = _merged(defaults, inventory.overrides, str(donors_path), "overrides")
    problem = token_file_problem(file_wide["hf_token_file"])
    if problem:
        origin = ((str(donors_path), "overrides.") if "hf_token_file" in inventory.overrides
                  else (str(defaults_path), ""))
        raise FleetError(f"{origin[0]}: field '{origin[1]}hf_token_file': {problem}")
    fleet: dict[str, dict] = {}
    # One box, one entry: values.box_identity's spelling, whatever the SSH port.
    seen_addresses: dict[str, str] = {}
    for name, entry in inventory.donors.items():
        where = f"{donors_path}: donor '{label(name)}'"
        if not isinstance(entry, dict):
            raise FleetError(f"{where}: must be a mapping, got {type(entry).__name__}")
        donor = _validate(schema.Donor, entry, where, known=schema.Donor.model_fields)
        merged = _merged(file_wide, donor.overrides, where, "overrides")
        problem = token_file_problem(donor.overrides.get("hf_token_file"))
        if problem:
            raise FleetError(f"{where}: field 'overrides.hf_token_file': {problem}")
        settings = schema.Defaults.model_validate(merged)
        data = _host_data(name, donor, merged, settings, where)
        data.update(_reach(name, donor, merged))
        address = values.box_identity(data["ssh_hostname"])
        # A tunnel address is checked against the other tunnel addresses (tunnel.plan).
        if address in seen_addresses and donor.reach == "direct":
            raise FleetError(f"{where}: field 'ssh_host': {data['ssh_hostname']} is the box of "
                             f"{seen_addresses[address]} (one box, one entry)")
        seen_addresses[address] = f"donor '{name}'"
        fleet[name] = data
    pools = _pools(fleet, donors_path)
    edges: dict[str, dict] = {}
    for name, entry in inventory.edges.items():
        where = f"{donors_path}: edge '{label(name)}'"
        if not isinstance(entry, dict):
            raise FleetError(f"{where}: must be a mapping, got {type(entry).__name__}")
        if name in fleet:
            raise FleetError(f"{where}: a donor has that name too (host names are unique)")
        if pki.is_operator_client(name):
            raise FleetError(f"{where}: name: the operator's own client certificates are named "
                             f"so ({', '.join(pki.OPERATOR_CLIENT_NAMES)}, operator-*): an edge "
                             "of that name would share the operator's pair")
        edge = _validate(schema.Edge, entry, where, known=schema.Edge.model_fields)
        merged = _merged(file_wide, edge.overrides, where, "overrides")
        data = _edge_data(name, edge, merged, fleet, pools, where)
        data.update(tunnel_endpoint=edge.tunnel_endpoint or edge.ssh_host,
                    tunnel_address=edge.tunnel_address,
                    tunnel_public_key=edge.tunnel_public_key, tunnel_settings=merged["tunnel"])
        address = values.box_identity(data["ssh_hostname"])
        if address in seen_addresses:
            raise FleetError(f"{where}: field 'ssh_host': {data['ssh_hostname']} is the box of "
                             f"{seen_addresses[address]} (one box, one entry)")
        seen_addresses[address] = f"edge '{name}'"
        edges[name] = data
    try:
        tunnel.plan(fleet, edges, {**{n: f"{donors_path}: donor '{label(n)}'" for n in fleet},
                                   **{n: f"{donors_path}: edge '{label(n)}'" for n in edges}})
    except tunnel.TunnelError as exc:
        raise FleetError(str(exc)) from None
    # Each donor's Caddy accepts exactly these client certificates: an edge deleted here loses
    # access at the donors' next deploy (donorkit/pki.py).
    for data in fleet.values():
        data["trusted_clients"] = [*sorted(edges), OPERATOR_CLIENT]
    if require_local_sources:
        for name, data in fleet.items():
            source = data["vllm_exl3_plugin"]
            # A cpu engine installs no plugin (deploy.py): its source is not needed.
            if data["card"].engine == "cuda" and "path" in source \
                    and not plugin_local_path(source).is_dir():
                raise FleetError(f"{donors_path}: donor '{name}': field 'vllm_exl3_plugin': "
                                 f"local path {plugin_local_path(source)} does not exist on "
                                 "this machine")
    return fleet, edges


def check_revisions(fleet: dict[str, dict], donors_path: Path | str | None = None) -> None:
    """Every model a donor serves has its checkpoint's commit pinned (`models.<m>.revision`), or
    one FleetError naming the donors file, the donor and the field: refused before any
    connection, not at the weights step after CUDA, vLLM and exllamav3 were installed. A
    checkpoint that is a path on the box has no revision."""
    where = donors_path or os.environ.get("DONORS_FILE") or DONORS_FILE
    for name, data in fleet.items():
        for model, profile in data["models"].items():
            if profile.get("revision") or profile["checkpoint"].startswith("/"):
                continue
            raise FleetError(f"{where}: donor '{name}': field 'models.{model}.revision': not "
                             f"pinned: `make lock` resolves {profile['checkpoint']} at its "
                             "branch (main) to its commit and writes it in")

