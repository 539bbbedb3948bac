"""Which carried wheels the GPU harness installs into the units' venv. gpu/engine_box.install runs
`VENV/bin/python gpu/carried_set.py STAGE/requirements.json` there (the venv sees the image's
site-packages, so `importlib.metadata` answers with the image's versions); it prints
`[[name, the version the image has or null], ...]`.

A carried wheel goes in where the image lacks the distribution, and where a distribution that will
be the carried version (vllm and ninja always, and each one going in) asks for another version
than the image's; until nothing changes. A requirement of a carried version that does not go in
(the image's copy stays) does not count: on 2026-12-03 the carried set's transformers 5.25 asked
for huggingface-hub >= 2.4, the image's transformers 5.17 (kept) refuses 2.x at import, and every
engine exited before loading a model (gpu/results/h200-engine-2026-12-03-evening/).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

ALWAYS = ("vllm", "ninja")  # into the venv whatever the image has (the units' PATH, FlashInfer)


def to_install(table: dict[str, dict], have: Callable[[str], str | None]) -> list[str]:
    """`table`: requirements.json's `carried` (each entry's `required_by` and `specifiers` are
    parallel lists); `have(name)`: the image's version, or None."""
    from packaging.specifiers import SpecifierSet

    need = {name for name in table if have(name) is None} | set(ALWAYS)
    while True:
        more = {name for name, entry in table.items() if name not in need and not all(
            have(name) in SpecifierSet(spec, prereleases=True)
            for by, spec in zip(entry["required_by"], entry["specifiers"], strict=True)
            if by in need)}
        if not more:
            return sorted(name for name in need if name in table)
        need |= more


def main(path: str) -> None:
    from importlib.metadata import PackageNotFoundError, version

    def have(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    table = json.loads(open(path).read())["carried"]
    print(json.dumps([[name, have(name)] for name in to_install(table, have)]))


if __name__ == "__main__":
    main(sys.argv[1])
