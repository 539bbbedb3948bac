"""Host data changed by a test: a DonorBox or EdgeBox (donorkit/inventory/host_data.py) is frozen,
so a test that puts a value straight into it (the schema bypassed: the render's own defences are
under test) gets a copy with that one value changed, at any depth (models, mappings, lists)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def get(node: Any, path: tuple) -> Any:
    for key in path:
        node = getattr(node, key) if isinstance(node, BaseModel) else node[key]
    return node


def put(node: Any, path: tuple, value: Any) -> Any:
    """`node` with the value at `path` replaced (copies along the path, nothing validated)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(node, BaseModel):
        return node.model_copy(update={key: put(getattr(node, key), rest, value)})
    if isinstance(node, dict):
        return {**node, key: put(node[key], rest, value)}
    copied = list(node)
    copied[key] = put(node[key], rest, value)
    return copied


def children(node: Any) -> list[tuple[Any, Any]]:
    """(key, value) of a model's fields, a mapping's items, a list's items; [] for a leaf."""
    if isinstance(node, BaseModel):
        return [(k, getattr(node, k)) for k in type(node).model_fields]
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, list):
        return list(enumerate(node))
    return []
