"""The inventory's files as read: YAML with duplicate keys refused (PyYAML keeps the last one),
and every mistake in them as one FleetError line naming the file, the entry (donor or edge) and
the field, pydantic's error locations turned into the data's own spelling (`models.qwen.port`).
donorkit.fleet loads the fleet with these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from donorkit import values


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


def short(value: Any) -> str:
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
            return f"key {short(value)}: must be {_EXPECTED[kind]}"
        return f"must be {_EXPECTED[kind]}, got {type(value).__name__} {short(value)}"
    message = error["msg"]
    return f"{message[:1].lower()}{message[1:]}, got {short(value)}"


def validate(model: type[BaseModel], data: Any, where: str, prefix: str = "",
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


def check_strings(doc: Any, path: Path) -> None:
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
