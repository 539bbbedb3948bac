"""donorkit's layout says its architecture (docs/layout.md): four wings, each importing only the
ones below it, inventory <- render <- box <- commands, and no import circle. Read from the
source with ast: every import counts, a function's own and a TYPE_CHECKING one included, so a
circle cannot hide behind an import made late. No private name (`_x`) crosses a module."""

from __future__ import annotations

import ast
from pathlib import Path

from donorkit.inventory.paths import REPO_ROOT

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
