"""donorkit's layout says its architecture (docs/layout.md): four wings, each importing only the
ones below it, inventory <- render <- box <- commands, and no import circle. Read from the
source with ast: every import counts, a function's own and a TYPE_CHECKING one included, so a
circle cannot hide behind an import made late. No private name (`_x`) crosses a module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from donorkit.inventory.paths import REPO_ROOT
from tests.support import old_paths

PACKAGE = REPO_ROOT / "donorkit"
# The floor of each wing: a module may import its own wing's and the lower ones'. The modules
# at the top of donorkit/ are the old `python -m donorkit.X` names kept for operators' scripts.
WINGS = {"inventory": 0, "render": 1, "box": 2, "commands": 3}
SHIMS = 4


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def imported(tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(donorkit module, names taken from it) for every import in the tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names
                      if alias.name.split(".")[0] == "donorkit"]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "donorkit":
            assert node.level == 0, "relative import"
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append((child, []) if child in known else (node.module, [alias.name]))
    return found


def wing(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) == 1:
        return None                      # donorkit/__init__.py: the version only
    return WINGS.get(parts[1], SHIMS)


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: {target for target, _ in imported(tree, known)
                   if target in known and wing(target) is not None}
            for name, tree in trees.items()}


def test_the_package_has_its_four_wings() -> None:
    names = set(modules())
    for part in WINGS:
        assert f"donorkit.{part}" in names
    loose = sorted(n for n in names if wing(n) == SHIMS)
    # Only the kept `python -m` names sit outside the wings, and each only runs a command.
    assert loose == ["donorkit.rollout", "donorkit.tunnel_join"]
    for name in loose:
        targets = graph()[name]
        assert targets and all(t.startswith("donorkit.commands.") for t in targets), name


def test_each_wing_imports_only_downward() -> None:
    wrong = [f"{source} -> {target}" for source, targets in graph().items()
             for target in targets if wing(source) is not None and wing(target) > wing(source)]
    assert not wrong, wrong


def test_no_import_circle() -> None:
    edges = graph()
    state: dict[str, int] = {}           # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_the_check_sees_a_function_import_and_an_upward_one() -> None:
    """The graph is read from real imports: an upward one and a function's own are found."""
    tree = ast.parse("def f():\n    from donorkit.commands.cli import main\n"
                     "from donorkit.render import templates\n")
    known = {"donorkit.commands.cli", "donorkit.render.templates"}
    assert sorted(t for t, _ in imported(tree, known)) == sorted(known)
    assert wing("donorkit.commands.cli") > wing("donorkit.inventory.fleet")


def test_no_private_name_crosses_a_module() -> None:
    trees = modules()
    known = set(trees)
    crossing = []
    for name, tree in trees.items():
        taken = [(source, n) for source, names in imported(tree, known) for n in names]
        crossing += [f"{name} imports {source}.{n}" for source, n in taken
                     if n.startswith("_") and not n.startswith("__")]
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("donorkit"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and node.attr.startswith("_") and \
                    not node.attr.startswith("__"):
                crossing.append(f"{name} uses {aliases[node.value.id]}.{node.attr}")
    assert not crossing, crossing


# The shared test helpers (tests/support/): a package that bench/, gpu/ and tests/ import by
# public names only, at its own path.
SUPPORT = REPO_ROOT / "tests/support"


def support_imports(path: Path, source: str | None = None
                    ) -> list[tuple[str, list[str], list[str]]]:
    """(tests.support module, names taken from it, attributes read through its alias) for every
    import of one in a file (`source`: its text, else read); relative imports inside
    tests/support resolved."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    modules = {p.stem for p in SUPPORT.glob("*.py")}
    found: list[tuple[str, list[str], list[str]]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if path.parent != SUPPORT:
                    continue
                base = f"tests.support.{base}".rstrip(".")
            if not base.startswith("tests.support"):
                continue
            for alias in node.names:
                if base == "tests.support" and alias.name in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                    found.append((f"{base}.{alias.name}", [], []))
                else:
                    found.append((base, [alias.name], []))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tests.support.") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in aliases:
            found.append((aliases[node.value.id], [], [node.attr]))
    return found


def python_files() -> list[Path]:
    return [path for folder in ("bench", "gpu", "tests", "pyinfra_declared")
            for path in sorted((REPO_ROOT / folder).rglob("*.py"))]


def test_the_test_helpers_cross_modules_by_public_names_only() -> None:
    crossing = [f"{path.relative_to(REPO_ROOT)}: {source}.{name}"
                for path in python_files()
                for source, names, attrs in support_imports(path)
                for name in [*names, *attrs]
                if name.startswith("_") and not name.startswith("__")
                and source != module_name(path)]
    assert not crossing, crossing


def test_the_test_helpers_are_imported_at_their_own_path() -> None:
    """The old paths (tests.testbed.X, tests.unit.X: tests/support/old_paths.py) are for
    branches written before the move; this repository's own code imports tests.support."""
    moved = {f"{package}.{leaf}" for package, leaves in old_paths.MOVED.items()
             for leaf in leaves}
    old = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and not node.level else [])
            old += [f"{path.relative_to(REPO_ROOT)}: {n}" for n in names if n in moved]
    assert not old, old


def test_the_helpers_package_says_what_each_module_is() -> None:
    import tests.support

    listed = set(re.findall(r"^- (\w+): ", tests.support.__doc__ or "", re.M))
    on_disk = {p.stem for p in SUPPORT.glob("*.py")} - {"__init__", "old_paths"}
    assert listed == on_disk


def test_the_helper_check_sees_a_private_name() -> None:
    """Read from real imports: a name taken, an attribute read through an alias, a relative
    import inside the package."""
    source = ("from tests.support.hosts import _load\nfrom tests.support import hosts as bed\n"
              "bed._save({})\nfrom .common import _private\n")
    taken = support_imports(SUPPORT / "probe.py", source)
    assert ("tests.support.hosts", ["_load"], []) in taken
    assert ("tests.support.hosts", [], ["_save"]) in taken
    assert ("tests.support.common", ["_private"], []) in taken
