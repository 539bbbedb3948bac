"""`LIMIT=` / `--limit`: one meaning for every command that takes it (verify, accept, status),
the one pyinfra's own `--limit` has: each pattern is a group name (`donors`, `edges`, a card
profile such as `rtx4090`), else a glob on host names (`tb-4090`, `tb-*`); several patterns
(repeated, or a comma list) add up. A pattern that matches nothing is refused with one line
(pyinfra only warns: a typo would then silently check fewer boxes)."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch

from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import DonorBox, EdgeBox


class LimitError(DonorsError, ValueError):
    """A pattern that matches no host; the message is the one line to print."""


def patterns(values: Iterable[str] | None) -> list[str]:
    """Repeated options and comma lists, flattened; blanks dropped."""
    return [p.strip() for value in values or [] for p in value.split(",") if p.strip()]


def groups(fleet: dict[str, DonorBox], edges: dict[str, EdgeBox]) -> dict[str, list[str]]:
    """{group: host names}, the groups inventory/gpus.py gives pyinfra
    (donorkit/box/inventory_groups.py): `donors` (every GPU box), `edges`, and one group per
    card profile (e.g. `rtx4090`)."""
    named: dict[str, list[str]] = {"donors": list(fleet), "edges": list(edges)}
    for name, box in fleet.items():
        named.setdefault(box.card.name, []).append(name)
    return named


def select(values: Iterable[str] | None, fleet: dict[str, DonorBox], edges: dict[str, EdgeBox]
           ) -> tuple[dict[str, DonorBox], dict[str, EdgeBox]]:
    """The donors and edges the patterns name, in inventory order (all of them with none)."""
    wanted = patterns(values)
    if not wanted:
        return dict(fleet), dict(edges)
    by_group = groups(fleet, edges)
    names = [*fleet, *edges]
    chosen: set[str] = set()
    for pattern in wanted:
        hits = by_group[pattern] if pattern in by_group else \
            [n for n in names if fnmatch(n, pattern)]
        if not hits:
            raise LimitError(
                f"limit '{pattern}' matches no host (hosts: {', '.join(names)}; groups: "
                f"{', '.join(sorted(by_group))}; globs such as 'tb-*' match host names)")
        chosen.update(hits)
    return ({n: d for n, d in fleet.items() if n in chosen},
            {n: d for n, d in edges.items() if n in chosen})
