"""Load and validate the fleet (donors.yml + defaults.yml) into per-host pyinfra data.

Every user mistake becomes one FleetError naming the file, the entry and the field, raised
before any connection is made.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml

from donorkit.paths import REPO_ROOT, repo_path

DEFAULTS_FILE = REPO_ROOT / "inventory" / "defaults.yml"
DONORS_FILE = REPO_ROOT / "inventory" / "donors.yml"

DONOR_FIELDS = {"ssh_host": str, "ssh_user": str, "card": str, "routes": dict}
OPTIONAL_DONOR_FIELDS = {"ssh_port": int, "ssh_key": str, "ssh_known_hosts_file": str,
                         "overrides": dict}
CARD_FIELDS = {"gpu_name": str, "arch": str, "cuda": str, "pip_index_url": str,
               "pip_extra_index_urls": list}
MODEL_FIELDS = {"checkpoint": str, "port": int, "max_model_len": int, "args": list,
                "environment": dict}
# Flags the template owns: vLLM must bind loopback only, and an alias hides the checkpoint.
FORBIDDEN_MODEL_ARGS = ("--host", "--port", "--served-model-name")
HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
CUDA_RE = re.compile(r"^\d+\.\d+$")


class FleetError(Exception):
    """A mistake in the inventory data; the message names file, entry and field."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml(path: Path) -> Any:
    """Parse one YAML file, turning every read/parse problem into a FleetError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise FleetError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise FleetError(f"{path}: malformed YAML{where}: {problem}") from None


def _check_fields(where: str, entry: Any, required: dict, optional: dict | None = None) -> None:
    if not isinstance(entry, dict):
        raise FleetError(f"{where}: must be a mapping, got {type(entry).__name__}")
    optional = optional or {}
    for field, value in entry.items():
        kind = required.get(field) or optional.get(field)
        if kind is None:
            known = ", ".join(sorted({**required, **optional}))
            raise FleetError(f"{where}: field '{field}': unknown field (known: {known})")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FleetError(f"{where}: field '{field}': must be {kind.__name__}, "
                             f"got {type(value).__name__} {value!r}")
    for field in required:
        if field not in entry:
            raise FleetError(f"{where}: field '{field}': missing")


def _check_profiles(path: Path, defaults: dict) -> None:
    for name, card in (defaults.get("cards") or {}).items():
        where = f"{path}: card '{name}'"
        _check_fields(where, card, CARD_FIELDS)
        if not CUDA_RE.match(card["cuda"]):
            raise FleetError(f"{where}: field 'cuda': expected MAJOR.MINOR, got {card['cuda']!r}")
    for name, model in (defaults.get("models") or {}).items():
        where = f"{path}: model '{name}'"
        _check_fields(where, model, MODEL_FIELDS)
        for arg in model["args"]:
            if str(arg).split("=")[0] in FORBIDDEN_MODEL_ARGS:
                raise FleetError(f"{where}: field 'args': {arg} is set by the deploy "
                                 "(--host 127.0.0.1 and the model's port; no alias)")


def _check_plugin_source(where: str, source: Any, require_local: bool) -> None:
    if not isinstance(source, dict) or not (
            set(source) == {"path"} or set(source) == {"git_url", "ref"}):
        raise FleetError(f"{where}: field 'vllm_exl3_plugin': must be {{path: DIR}} "
                         f"or {{git_url: URL, ref: REF}}, got {source!r}")
    if require_local and "path" in source:
        local = plugin_local_path(source)
        if not local.is_dir():
            raise FleetError(f"{where}: field 'vllm_exl3_plugin': local path {local} "
                             "does not exist on this machine")


def plugin_local_path(source: dict) -> Path:
    """The plugin's directory on the operator's machine (relative paths: from the repo root)."""
    return repo_path(source["path"])


def _host_data(name: str, donor: dict, defaults: dict, where: str) -> dict:
    """Everything the tasks and templates need for one host, derived once, here."""
    data = copy.deepcopy(defaults)
    for key, value in donor.get("overrides", {}).items():
        if key not in defaults:
            raise FleetError(f"{where}: field 'overrides.{key}': not a key of defaults.yml")
        data[key] = value
    cards, models = data.pop("cards"), data.pop("models")
    if donor["card"] not in cards:
        raise FleetError(f"{where}: field 'card': unknown card '{donor['card']}' "
                         f"(known: {', '.join(sorted(cards))})")
    if not donor["routes"]:
        raise FleetError(f"{where}: field 'routes': at least one hostname -> model is needed")
    for hostname, model in donor["routes"].items():
        if not isinstance(hostname, str) or not HOSTNAME_RE.match(hostname):
            raise FleetError(f"{where}: field 'routes': {hostname!r} is not a DNS hostname")
        if model not in models:
            raise FleetError(f"{where}: field 'routes.{hostname}': unknown model identity "
                             f"'{model}' (known: {', '.join(sorted(models))})")
    card = dict(cards[donor["card"]], name=donor["card"])
    served = sorted(set(donor["routes"].values()))
    cuda = card["cuda"]
    data.update(
        donor_name=name,
        ssh_hostname=donor["ssh_host"],
        ssh_user=donor["ssh_user"],
        ssh_port=donor.get("ssh_port", 22),
        card=card,
        cuda_version=cuda,
        cuda_home=f"/usr/local/cuda-{cuda}",
        cuda_package=f"cuda-toolkit-{cuda.replace('.', '-')}",
        routes=[{"hostname": h, "model": m} for h, m in sorted(donor["routes"].items())],
        models={m: dict(models[m], name=m, unit=f"vllm-{m}.service") for m in served},
        # Units of the identities this box does not serve: removed, so a switch frees the GPU.
        retired_units=[f"vllm-{m}.service" for m in sorted(models) if m not in served],
    )
    data["vllm_executable"] = data["vllm_executable"].format(venv_dir=data["venv_dir"])
    for field in ("ssh_key", "ssh_known_hosts_file"):
        if field in donor:  # relative paths are relative to the repo root, like everything else
            data[field] = str(repo_path(donor[field]))
    if donor["ssh_user"] != "root":
        data["_sudo"] = True
    return data


def load_fleet(donors_path: Path | str | None = None, defaults_path: Path | str | None = None,
               require_local_sources: bool = False) -> dict[str, dict]:
    """Return {donor name: host data}; raise FleetError on any mistake in either file."""
    donors_path = Path(donors_path or os.environ.get("DONORS_FILE") or DONORS_FILE)
    defaults_path = Path(defaults_path or DEFAULTS_FILE)
    defaults = read_yaml(defaults_path)
    if not isinstance(defaults, dict) or "cards" not in defaults or "models" not in defaults:
        raise FleetError(f"{defaults_path}: must be a mapping with 'cards' and 'models'")
    _check_profiles(defaults_path, defaults)
    doc = read_yaml(donors_path)
    if not isinstance(doc, dict) or not isinstance(doc.get("donors"), dict) or not doc["donors"]:
        raise FleetError(f"{donors_path}: must be a mapping with a non-empty 'donors' mapping")
    _check_fields(str(donors_path), doc, {"donors": dict}, {"overrides": dict})
    fleet: dict[str, dict] = {}
    seen_addresses: dict[tuple, str] = {}
    for name, donor in doc["donors"].items():
        where = f"{donors_path}: donor '{name}'"
        _check_fields(where, donor, DONOR_FIELDS, OPTIONAL_DONOR_FIELDS)
        merged = {"overrides": {**doc.get("overrides", {}), **donor.get("overrides", {})}}
        data = _host_data(name, {**donor, **merged}, defaults, where)
        address = (data["ssh_hostname"], data["ssh_port"])
        if address in seen_addresses:
            raise FleetError(f"{where}: field 'ssh_host': {address[0]}:{address[1]} is already "
                             f"used by donor '{seen_addresses[address]}'")
        seen_addresses[address] = name
        fleet[name] = data
    for name, data in fleet.items():
        _check_plugin_source(f"{donors_path}: donor '{name}'", data["vllm_exl3_plugin"],
                             require_local_sources)
    return fleet
