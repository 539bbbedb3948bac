"""Property: whatever the donors file says, `make render` either renders or exits 2 with one line
naming the file (never a traceback, never a half-written tree).

Hypothesis mutates the shipped donors file, with the testbed's overrides and edge added (a rich
set of keys), thousands of times: values replaced by other types and by strings with quotes,
`$`, `%`, newlines and non-ASCII, keys deleted or added, values nested into lists and mappings,
and any defaults.yml key (at any depth) set in a donor's or the file's `overrides`. Each case goes
through donorkit.commands.render_cli.main, the code `make render` runs. The number of cases and the
time they took are printed (pytest -s). The second test (issue 21) takes every string field and key,
edges included, and reads every accepted value back through the real `caddy adapt`."""

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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from donorkit.commands import render_cli
from donorkit.inventory.fleet import DEFAULTS_FILE, DONORS_FILE
from donorkit.inventory.host_data import DonorBox, EdgeBox
from donorkit.inventory.paths import REPO_ROOT

CASES = int(os.environ.get("UNCLOSEAI_PROPERTY_CASES", "2000"))
SHIPPED = yaml.safe_load(DONORS_FILE.read_text())
TESTBED = yaml.safe_load((REPO_ROOT / "tests/testbed/donors.yml").read_text())
DEFAULTS = yaml.safe_load(DEFAULTS_FILE.read_text())
BASE = {"overrides": dict(TESTBED["overrides"], vllm_exl3_plugin={"path": "tests"}),
        "donors": SHIPPED["donors"], "edges": TESTBED["edges"]}


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


# ------------------------------------------------------------------ issue 21: every string -----
# Every string of the inventory, edges included, keys too: each string leaf and each key of the
# testbed's donors file (two donors, the edge), and each string leaf and data key of defaults.yml
# set through the file's, a donor's or the edge's `overrides`, gets values built to break out of
# where it lands (newlines, quotes, braces, `{$ENV}`, zone ids, separators, backslashes ...),
# plain ones, and hypothesis' own text. A value is refused with one line naming the file, or
# accepted; every accepted value renders, for every host, to a Caddyfile that the real
# `caddy adapt` reads back with exactly the sites, listeners, upstreams and files the data names
# and the template's shape (tests/support/rendered_shape.py), and to units with exactly the
# template's lines.
TB = yaml.safe_load((REPO_ROOT / "tests/testbed/donors.yml").read_text())
STRING_BASE = {"overrides": dict(TB["overrides"], vllm_exl3_plugin={"path": "tests"}),
               "donors": {n: TB["donors"][n] for n in ("tb-4090", "tb-3090")},
               "edges": {"tb-edge": dict(TB["edges"]["tb-edge"], hostnames="all")}}
PER_STRING = int(os.environ.get("UNCLOSEAI_STRING_CASES", "3"))
SITE = "]:443\n}\n}\nevil.example.com:80 {\n\tfile_server\n}\nx.example.com {\n\tlog {\n#"
BREAKERS = ["\n", "\r", "}", "{", '"', "'", " ", "\t", "\\", "#", "{$HOME}", "%eth0", ";", "`",
            "<<EOF", "\u2028", "\u202e", "\x00", "$x", "%h", "\nUser=root",
            "\n}\nevil.example.com {\n\tfile_server\n}\n", '" {', ":1", "/..", "..", "@x"]


def strings_and_keys(node: Any, prefix: tuple = ()) -> list[tuple[str, tuple]]:
    """("str", path) for each string leaf, ("key", path) for each mapping key, at any depth."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append(("key", (*prefix, key)))
            found += strings_and_keys(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += strings_and_keys(value, (*prefix, i))
    elif isinstance(node, str):
        found.append(("str", prefix))
    return found


# Keys that are data (names, hostnames, environment names), not field names.
_DATA_MAPS = {"donors", "edges", "routes", "cards", "models", "environment", "unit_environment",
              "unit_service", "cuda_driver_minimums"}
TARGETS = ([("doc", kind, path) for kind, path in strings_and_keys(STRING_BASE)
            if kind == "str" or path[-2:-1] and path[-2] in _DATA_MAPS] +
           [("defaults", kind, path) for kind, path in strings_and_keys(DEFAULTS)
            if kind == "str" or path[-2:-1] and path[-2] in _DATA_MAPS])


def string_values(original: str) -> st.SearchStrategy[str]:
    breaker = st.sampled_from(BREAKERS)
    return st.one_of(
        st.just(original), st.just(original + "x"), st.just(original + "-1"),
        st.builds(lambda b: original + b, breaker), st.builds(lambda b: b + original, breaker),
        st.builds(lambda b, i: original[:i] + b + original[i:], breaker,
                  st.integers(0, max(len(original), 1))),
        st.text(max_size=10))


def place(doc: dict, target: tuple, value: str, where: tuple) -> dict:
    """`doc` with the target string (or key) replaced by value."""
    doc = copy.deepcopy(doc)
    source, kind, path = target
    if source == "doc":
        parent = get(doc, path[:-1])
        if kind == "key":
            parent[value] = parent.pop(path[-1])
        else:
            parent[path[-1]] = value
        return doc
    node = get(doc, where).setdefault("overrides", {})
    # A list is replaced whole by an override: carry the rest of it along.
    cut = next((i for i, key in enumerate(path) if isinstance(key, int)), len(path))
    for key in path[:cut - 1]:
        node = node.setdefault(key, {})
    if cut < len(path):
        original = copy.deepcopy(get(DEFAULTS, path[:cut]))
        inner = original
        for key in path[cut:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        node[path[cut - 1]] = original
    elif kind == "key":
        node[value] = copy.deepcopy(get(DEFAULTS, path))
    else:
        node[path[-1]] = value
    return doc


def test_every_string_field_is_refused_in_one_line_or_renders_as_data() -> None:
    from donorkit.inventory.fleet import FleetError, load_inventory
    from tests.support import rendered_shape as shape

    started, stats = time.monotonic(), {"cases": 0, "refused": 0, "rendered": 0}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        references: dict[tuple, tuple[dict, str]] = {}

        def reference(name: str, data: DonorBox | EdgeBox) -> tuple[dict, str]:
            """The unmutated file's config for this host (or, renamed, for its role) with the
            same public_tls, and its Caddyfile's text (the same text needs no second adapt)."""
            edge = data.role == "edge"
            known = name if name in ("tb-4090", "tb-3090", "tb-edge") else \
                "tb-edge" if edge else "tb-4090"
            key = (known, data.public_tls if edge else None)
            if key not in references:
                base = copy.deepcopy(STRING_BASE)
                if edge:
                    base["edges"]["tb-edge"]["public_tls"] = data.public_tls
                base["overrides"]["pki_dir"] = str(work / "pki")
                path = work / "reference.yml"
                path.write_text(yaml.safe_dump(base))
                fleet, edges = load_inventory(path)
                caddyfile = shape.lay_out(shape.in_tmp({**fleet, **edges}[known], work), work)[0]
                references[key] = (shape.adapt(caddyfile), caddyfile.read_text())
            config, text = references[key]
            return config, text if known == name else ""

        def check(doc: dict) -> None:
            path = work / "donors.yml"
            doc = copy.deepcopy(doc)
            doc.setdefault("overrides", {})["pki_dir"] = str(work / "pki")
            path.write_text(yaml.safe_dump(doc, allow_unicode=True))
            stats["cases"] += 1
            try:
                fleet, edges = load_inventory(path)
            except FleetError as exc:
                stats["refused"] += 1
                assert "\n" not in str(exc) and str(exc).startswith(f"{path}: "), str(exc)
                return
            stats["rendered"] += 1
            for name, data in [*fleet.items(), *edges.items()]:
                config, text = reference(name, data)
                shape.check_host(shape.in_tmp(data, work), work, config, text)

        hosts = [("overrides",), ("donors", "tb-4090"), ("donors", "tb-3090"),
                 ("edges", "tb-edge")]
        def cases_for(target: tuple) -> Any:
            original = target[2][-1] if target[1] == "key" else get(
                STRING_BASE if target[0] == "doc" else DEFAULTS, target[2])

            # Always tried, beside hypothesis' draws: a whole site after the value, and after
            # an IPv6 zone id (the audit's address), closing a quoted token.
            @settings(max_examples=PER_STRING, deadline=None, database=None,
                      derandomize=not os.environ.get("UNCLOSEAI_PROPERTY_RANDOM"),
                      suppress_health_check=list(HealthCheck))
            @given(value=string_values(str(original)), where=st.sampled_from(hosts))
            @example(value=f"{original}{SITE}", where=("overrides",))
            @example(value=f"fe80::1%eth0{SITE}", where=("edges", "tb-edge"))
            @example(value=f'{original}" {{', where=("donors", "tb-4090"))
            def case(value: str, where: tuple) -> None:
                check(place(STRING_BASE, target, value, () if where == ("overrides",)
                            else where))

            return case

        for target in TARGETS:
            cases_for(target)()
    took = time.monotonic() - started
    print(f"\nevery string: {len(TARGETS)} strings and keys, {stats['cases']} cases "
          f"({stats['rendered']} rendered and read back, {stats['refused']} refused with one "
          f"line) in {took:.1f} s")
    assert stats["rendered"] > len(TARGETS) // 2 and stats["refused"] > len(TARGETS)
