"""docs/layout.md says what the tree holds: every module it names exists, every module of the
two packages (donorkit's wings included) is named there, and its example operation is the code as
it is."""

from __future__ import annotations

import inspect
import re

from donorkit.inventory.paths import REPO_ROOT
from pyinfra_declared import files

LAYOUT = (REPO_ROOT / "docs/layout.md").read_text()


def test_the_example_operation_is_the_code() -> None:
    example = LAYOUT.split("```python\n", 1)[1].split("```", 1)[0]
    assert example == inspect.getsource(files.owned_file)


def test_every_module_of_both_packages_is_named_and_every_name_exists() -> None:
    for package in ("donorkit", "pyinfra_declared"):
        root = REPO_ROOT / package
        modules = {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"
                   and "tests" not in p.relative_to(root).parts}
        section = LAYOUT.split(f"## `{package}/`", 1)[1].split("\n## ", 1)[0]
        named = set(re.findall(r"`([a-z_/]+\.py)`", section))
        assert modules - named == set(), f"{package}: not in docs/layout.md"
        assert named - modules == set(), f"{package}: named in docs/layout.md, not there"
    for task in (REPO_ROOT / "tasks").glob("[!_]*.py"):
        assert f"`{task.stem}`" in LAYOUT, task.name
