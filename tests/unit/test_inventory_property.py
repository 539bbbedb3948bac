"""Property: whatever the donors file says, `make render` either renders or exits 2 with one line
naming the file (never a traceback, never a half-written tree).

Hypothesis mutates the shipped donors file, with the testbed's overrides added (a rich set of
keys), thousands of times: values replaced by other types and by strings with quotes, `$`, `%`,
newlines and non-ASCII, keys deleted or added, values nested into lists and mappings, and any
defaults.yml key (at any depth) set in a donor's or the file's `overrides`. Each case goes
through donorkit.render_cli.main, the code `make render` runs. The number of cases and the time
they took are printed (pytest -s)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from donorkit import render_cli
from donorkit.fleet import DEFAULTS_FILE, DONORS_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = int(os.environ.get("UNCLOSEAI_PROPERTY_CASES", "2000"))
SHIPPED = yaml.safe_load(DONORS_FILE.read_text())
TESTBED = yaml.safe_load((REPO_ROOT / "tests/testbed/donors.yml").read_text())
DEFAULTS = yaml.safe_load(DEFAULTS_FILE.read_text())
BASE = {"overrides": dict(TESTBED["overrides"], vllm_exl3_plugin={"path": "tests"}),
        "donors": SHIPPED["donors"]}


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a YAML document."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += paths(value, (*prefix, i))
    return found


DEFAULT_PATHS = [p for p in paths(DEFAULTS) if all(isinstance(k, str) for k in p)]
NASTY = st.sampled_from(["", " ", "a\nb", "it's", '"', "$HOME", "50%", "\\", "-oProxyCommand=x",
                         "../../x", "/tmp/x y", "é", "--host=0.0.0.0", "--served_model_name",
                         "0.0.0.0", "443", "18888", "yes", "null", "{x}", "a;b", "\t", "\x00",
                         "x" * 300, "hermes", "qwen", "rtx4090", "Api-Key", "/opt/x"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(),
                    st.sampled_from([0, 1, 22, 443, 18888, 18889, 65535, 65536, -1]), NASTY,
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(NASTY, st.text(max_size=6)), inner,
                                                 max_size=3)), max_leaves=6)


def get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    doc = yaml.safe_load(yaml.safe_dump(BASE))  # a deep copy
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "delete", "add", "wrap", "override",
                                       "override", "override"]))
        if action == "override":
            donors = doc["donors"] if isinstance(doc.get("donors"), dict) else {}
            where = draw(st.sampled_from([("overrides",),
                                          *[("donors", n, "overrides") for n in donors]]))
            path = draw(st.sampled_from(DEFAULT_PATHS))
            original = copy.deepcopy(get(DEFAULTS, path))  # DEFAULTS itself stays as read
            value = draw(st.one_of(VALUES, st.just(original), st.just([original]),
                                   st.just(str(original))))
            node = doc
            for key in where:
                node = node.setdefault(key, {}) if isinstance(node, dict) else node
            if not isinstance(node, dict):
                continue
            for key in path[:-1]:
                child = node.get(key)
                node[key] = child if isinstance(child, dict) else {}
                node = node[key]
            node[path[-1]] = value
            continue
        targets = paths(doc)
        if not targets:
            continue
        path = draw(st.sampled_from(targets))
        parent = get(doc, path[:-1])
        key = path[-1]
        if action == "replace":
            parent[key] = draw(VALUES)
        elif action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(NASTY, st.text(max_size=8)))] = draw(VALUES)
        elif action == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"x": parent[key]}]))
    return doc


def render(doc: dict, work: Path) -> tuple[int, str]:
    """`make render` on this document: exit code and stderr."""
    path = work / "donors.yml"
    doc = copy.deepcopy(doc)
    # The CA stays in the test's directory, never the checkout's pki/ (tests/unit/conftest.py):
    # file-wide, and wherever a mutation put a string pki_dir in an entry's overrides.
    if "overrides" not in doc:
        doc["overrides"] = {}
    if isinstance(doc["overrides"], dict):
        doc["overrides"]["pki_dir"] = str(work / "pki")
    for group in ("donors", "edges"):
        entries = doc.get(group)
        for entry in entries.values() if isinstance(entries, dict) else []:
            overrides = entry.get("overrides") if isinstance(entry, dict) else None
            if isinstance(overrides, dict) and isinstance(overrides.get("pki_dir"), str):
                overrides["pki_dir"] = str(work / "pki")
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    names = (list(doc["donors"]) if isinstance(doc.get("donors"), dict) else []) or ["x"]
    shutil.rmtree(work / "out", ignore_errors=True)  # render refuses an OUT that exists
    stderr = io.StringIO()
    old = os.environ.get("DONORS_FILE")
    os.environ["DONORS_FILE"] = str(path)
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = render_cli.main(["--", str(names[0]), str(work / "out")])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        if old is None:
            del os.environ["DONORS_FILE"]
        else:
            os.environ["DONORS_FILE"] = old
    return code, stderr.getvalue()


STATS = {"cases": 0, "rendered": 0, "refused": 0}


def test_any_mutation_renders_or_exits_2_with_one_line() -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        # The same cases on every run (derandomize), so CI is repeatable; set
        # UNCLOSEAI_PROPERTY_RANDOM=1 to explore new ones.
        @settings(max_examples=CASES, deadline=None, database=None,
                  derandomize=not os.environ.get("UNCLOSEAI_PROPERTY_RANDOM"),
                  suppress_health_check=list(HealthCheck))
        @given(doc=mutated())
        def case(doc: dict) -> None:
            STATS["cases"] += 1
            code, stderr = render(doc, work)
            lines = stderr.splitlines()
            if code == 0:
                STATS["rendered"] += 1
                assert not stderr
                return
            STATS["refused"] += 1
            assert code == 2, stderr
            assert len(lines) == 1, stderr
            assert lines[0].startswith(("inventory error: ", "render: no donor named ")), stderr
            assert "Traceback" not in stderr
            assert lines[0].startswith(f"inventory error: {work / 'donors.yml'}") or \
                lines[0].startswith("render: no donor named "), stderr

        case()
    took = time.monotonic() - started
    print(f"\nproperty test: {STATS['cases']} cases ({STATS['rendered']} rendered, "
          f"{STATS['refused']} refused with one line) in {took:.1f} s")
    assert STATS["rendered"] > 0 and STATS["refused"] > STATS["cases"] // 4
