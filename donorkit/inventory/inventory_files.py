"""The inventory's files as read: YAML with duplicate keys refused (PyYAML keeps the last one),
and every mistake in them as one FleetError line naming the file, the entry (donor or edge) and
the field, pydantic's error locations turned into the data's own spelling (`models.qwen.port`).
donorkit.inventory.fleet loads the fleet with these."""

from __future__ import annotations

import os
import stat
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from donorkit.inventory import values
from donorkit.inventory.errors import DonorsError


class FleetError(DonorsError):
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
        if not isinstance(key, Hashable):  # `? [a]` or `? {a: 1}`: PyYAML's own TypeError
            raise yaml.constructor.ConstructorError(
                None, None, f"a {type(key).__name__} cannot be a mapping key",
                key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


def _construct_object(loader: yaml.SafeLoader, node: yaml.Node, deep: bool = False) -> Any:
    """PyYAML's construct_object, a value it cannot build (a 13th month, an integer of more
    than 4300 digits) a YAML error at its place rather than Python's ValueError."""
    try:
        return yaml.SafeLoader.construct_object(loader, node, deep)
    except (ValueError, OverflowError) as exc:
        raise yaml.constructor.ConstructorError(
            None, None, f"{short(node.value)} cannot be read: {exc}", node.start_mark) from None


for _loader in (_UniqueKeyLoader, _FastUniqueKeyLoader):
    _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            _construct_unique_mapping)


class _BoundedLoader(_UniqueKeyLoader):
    """read_bounded_yaml's: a value PyYAML cannot build is a YAML error at its place."""

    construct_object = _construct_object


class _FastBoundedLoader(_FastUniqueKeyLoader):  # type: ignore[misc,valid-type]
    construct_object = _construct_object


# What an inventory file may be (defaults.yml is ~20 KB, a donors file of a hundred boxes less
# than that): the reader refuses anything past these before building a single Python value.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64           # mappings and lists inside each other
MAX_YAML_ALIASES = 1000       # `*name` uses of anchors
MAX_YAML_VALUES = 200_000     # values the document holds once every alias is expanded


@dataclass(frozen=True)
class YamlLimits:
    """What one kind of YAML file may be: read_bounded_yaml refuses a file past any of these."""

    kind: str = "an inventory file"
    bytes: int = MAX_YAML_BYTES
    depth: int = MAX_YAML_DEPTH
    aliases: int = MAX_YAML_ALIASES
    values: int = MAX_YAML_VALUES


INVENTORY_YAML = YamlLimits()


def _bounds_problem(text: str, limits: YamlLimits,
                    loader: type = _FastUniqueKeyLoader) -> tuple[str, Any] | None:
    """Why `text` is too big to read as data (its problem and the YAML mark where it shows), or
    None. One pass over libyaml's event stream (no recursion, nothing built): each anchor's
    expanded size is counted once, so an alias bomb (nine anchors of ten aliases each: 10^9
    strings once expanded, which every later walk would visit) is refused at the alias that
    crosses MAX_YAML_VALUES, and deep nesting at the level past MAX_YAML_DEPTH."""
    sizes: dict[str, int] = {}
    open_nodes: list[list] = []        # per open mapping or list: [its anchor, its size so far]
    aliases = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_nodes) >= limits.depth:
                return (f"nested deeper than {limits.depth} levels ({limits.kind} never is)",
                        event.start_mark)
            open_nodes.append([event.anchor, 1])
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > limits.aliases:
                return (f"more than {limits.aliases} aliases (& and *) for {limits.kind}",
                        event.start_mark)
            anchor, size = None, sizes.get(event.anchor, 1)
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if open_nodes:
            open_nodes[-1][1] += size
            size = open_nodes[-1][1]
        if size > limits.values:
            return (f"its aliases expand to more than {limits.values} values (an alias bomb?)",
                    event.start_mark)
    return None


def _malformed(path: Path, problem: str, mark: Any) -> FleetError:
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    return FleetError(f"{path}: malformed YAML{where}: {problem}")


def read_bounded_yaml(path: Path, limits: YamlLimits = INVENTORY_YAML) -> Any:
    """THE reader of every YAML file the operator or a volunteer hands us (defaults.yml, donors
    files, join files): one parsed document, or one FleetError line naming the file. Bounded
    before anything is built: the file's size (MAX_YAML_BYTES, read no further), its nesting
    (MAX_YAML_DEPTH), its aliases and what they expand to (MAX_YAML_ALIASES, MAX_YAML_VALUES);
    duplicate keys, unhashable keys and values PyYAML cannot build (a 13th month, an integer
    of 5000 digits) are refused too. What it returns is safe to walk recursively."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FleetError(f"{path}: not a regular file: not {limits.kind}")
        with path.open("rb") as handle:
            raw = handle.read(limits.bytes + 1)
    except OSError as exc:
        raise FleetError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > limits.bytes:
        raise FleetError(f"{path}: more than {limits.bytes} bytes: larger than {limits.kind} "
                         "may be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FleetError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        problem = _bounds_problem(text, limits)
    except yaml.YAMLError:
        # libyaml's terse word (or its own nesting limit): PyYAML's parser says where and what
        # (it is iterative too: nothing here recurses).
        try:
            problem = _bounds_problem(text, limits, _UniqueKeyLoader)
        except yaml.YAMLError as exc:
            problem = (getattr(exc, "problem", None) or str(exc),
                       getattr(exc, "problem_mark", None))
    if problem:
        raise _malformed(path, *problem)
    try:
        return yaml.load(text, Loader=_FastBoundedLoader)
    except yaml.YAMLError:
        pass
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise _malformed(path, getattr(exc, "problem", None) or str(exc), mark) from None


def read_yaml(path: Path) -> Any:
    """read_bounded_yaml (the name the inventory's readers have always used)."""
    return read_bounded_yaml(path)


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
                    "donorkit/inventory/unit_settings.py)")
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
