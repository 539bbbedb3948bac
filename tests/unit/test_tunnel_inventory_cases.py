"""Issue 32, hole 4: every case of tests/unit/tunnel_inventory_cases.yml. A must-refuse case is
refused in one line naming the file, the host and the field, before anything touches a host
(never a traceback, never a hang); a must-accept case loads and every host renders. The YAML
reader's cases (an alias bomb, deep nesting, ...) run in a fresh interpreter through `make
render`'s own entry point: a hang there is the loader's, and the loader must refuse by counting
(donorkit.inventory.inventory_files.read_bounded_yaml), well within the subprocess's timeout."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from donorkit.commands import render_cli
from donorkit.inventory import inventory_files
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render import templates as render
from donorkit.render import tunnel_files

CASES = yaml.safe_load((Path(__file__).parent / "tunnel_inventory_cases.yml").read_text())
BASES = {"tunnel": REPO_ROOT / "tests/testbed/donors-tunnel.yml",
         "direct": REPO_ROOT / "tests/testbed/donors.yml"}
KEYS = {"@key_a": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        "@key_b": "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=",
        "@key_c": "AgMEBQYHCAkKCwwNDg8QERITFBUWFxgZGhscHR4fICE=",
        "@key_d": "AwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISI=",
        # key b's last digit 'A' (000000) as 'B' (000001): its two low bits are not part of the
        # 32 bytes, so both spellings decode to the same key.
        "@key_b_other_spelling": "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyB="}
TEMPLATES = {
    "@direct": {"ssh_user": "root", "ssh_key": ".testbed/ssh/id_ed25519", "card": "rtx4090",
                "routes": {"hermes.ai.unturf.com": "qwen"}},
    "@home": {"reach": "tunnel", "ssh_user": "root", "card": "rtx4090",
              "routes": {"hermes.ai.unturf.com": "qwen"}},
    "@edge2": {"ssh_host": "10.213.0.21", "ssh_user": "root", "hostnames":
               ["hermes.ai.unturf.com"], "rate_limit": None, "public_tls": "private_ca"},
}
# A refusal comes well within this (the loader counts; it never waits for a walk to end).
LOADER_SECONDS = 20


def _expand(node: Any) -> Any:
    if isinstance(node, str):
        return KEYS.get(node, node)
    if isinstance(node, list):
        return [_expand(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for template, body in TEMPLATES.items():
        if node.get(template):
            out.update(copy.deepcopy(body))
    out.update({key: _expand(value) for key, value in node.items() if key not in TEMPLATES})
    return out


def _merge(base: dict, change: dict) -> dict:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _generate(kind: str, size: int) -> str:
    if kind == "deep_flow":
        return "donors: " + "[" * size + "]" * size + "\n"
    if kind == "deep_block":
        return "donors:\n" + "".join(f"{' ' * (i + 1)}k{i}:\n" for i in range(size)) + \
            f"{' ' * (size + 1)}x: 1\n"
    if kind == "large":
        return "donors: {}\n" + "# padding\n" * (size // 10)
    if kind == "latin1":
        return "donors:\n  box:\n    ssh_user: caf\xe9\n"
    if kind == "long_int":
        return "donors:\n  box:\n    ssh_port: " + "1" * size + "\n"
    raise ValueError(kind)


def case_text(case: dict, tmp_path: Path) -> str:
    """The donors file a case describes."""
    if "text" in case:
        return case["text"]
    if "generate" in case:
        [(kind, size)] = case["generate"].items()
        return _generate(kind, size)
    doc = yaml.safe_load(BASES[case.get("base", "tunnel")].read_text())
    doc["overrides"]["pki_dir"] = str(tmp_path / "pki")
    if case.get("base", "tunnel") == "tunnel":
        doc["edges"]["tb-edge"]["tunnel_public_key"] = KEYS["@key_a"]
        doc["donors"]["tb-home"]["tunnel_public_key"] = KEYS["@key_b"]
    for section, entries in _expand(case.get("first", {})).items():
        doc[section] = {**entries, **doc.get(section, {})}
    _merge(doc, _expand(case.get("merge", {})))
    for path in case.get("drop", []):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1])
    if case.get("share_entries"):  # one mapping for every such entry: written as YAML aliases
        shared = doc["donors"][case["share_entries"]]
        for name, entry in doc["donors"].items():
            if entry == shared:
                doc["donors"][name] = shared
    order = case.get("text_order", list(doc))
    return yaml.safe_dump({key: doc[key] for key in order if key in doc}, sort_keys=False)


def _ids(section: str) -> list:
    return [pytest.param(case, id=case["id"]) for case in CASES[section]]


def _load_in_a_fresh_interpreter(path: Path) -> tuple[int, str, float]:
    """`make render`'s entry point on the file: its exit status, its stderr, its seconds."""
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "donorkit.commands.render_cli", "box", str(path.parent / "out")],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=LOADER_SECONDS,
            env={**os.environ, "DONORS_FILE": str(path)})
    except subprocess.TimeoutExpired:
        return -1, f"still loading after {LOADER_SECONDS}s", time.monotonic() - start
    return result.returncode, result.stderr, time.monotonic() - start


@pytest.mark.parametrize("case", _ids("must_refuse"))
def test_must_refuse(case: dict, tmp_path: Path) -> None:
    path = tmp_path / "donors.yml"
    text = case_text(case, tmp_path)
    path.write_bytes(text.encode("latin-1" if "latin1" in case.get("generate", {}) else "utf-8"))
    if "text" in case or "generate" in case:
        status, stderr, seconds = _load_in_a_fresh_interpreter(path)
        assert status == 2 and stderr.count("\n") == 1, (status, stderr[-2000:])
        message = stderr.removeprefix("inventory error: ").rstrip("\n")
        assert seconds < LOADER_SECONDS / 2, seconds
    else:
        try:
            load_inventory(path)
        except FleetError as exc:
            message = str(exc)
        else:
            pytest.fail(f"{case['id']}: accepted")
    assert "\n" not in message, message
    assert message.startswith(f"{path}: "), message
    if "field" in case:
        named = f"field '{case['field']}'"
        where = f"{case['where']}: {named}" if "where" in case else f"{path}: {named}"
        assert where in message, message
    assert case.get("says", "") in message, message


def _value(node: Any, dotted: list[str]) -> Any:
    for part in dotted:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@pytest.mark.parametrize("case", _ids("must_accept"))
def test_must_accept(case: dict, tmp_path: Path) -> None:
    path = tmp_path / "donors.yml"
    path.write_text(case_text(case, tmp_path))
    fleet, edges = load_inventory(path)
    hosts = {**fleet, **edges}
    for data in hosts.values():
        assert render.render_host(data)
        if data.tunnel is not None:
            assert tunnel_files.render_conf(data.tunnel) and tunnel_files.render_nft(data.tunnel)
    for dotted, expected in case.get("expect", {}).items():
        host, *rest = dotted.split(".")
        assert _value(hosts[host], rest) == expected, dotted


def test_the_shipped_inventories_still_load_and_render(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """inventory/donors.yml (its PKI under tmp_path) and the testbed's tunnel fleet, through
    `make render`'s own code."""
    shipped = yaml.safe_load((REPO_ROOT / "inventory/donors.yml").read_text())
    shipped["overrides"] = {"pki_dir": str(tmp_path / "pki")}
    (tmp_path / "shipped.yml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    (tmp_path / "tunnel.yml").write_text(case_text({"id": "testbed"}, tmp_path))
    for name, host in (("shipped", "edge-1"), ("shipped", "hermes-4090"),
                       ("tunnel", "tb-home"), ("tunnel", "tb-edge")):
        monkeypatch.setenv("DONORS_FILE", str(tmp_path / f"{name}.yml"))
        out = tmp_path / f"out-{name}-{host}"
        assert render_cli.main([host, str(out)]) == 0
        assert (out / "etc/caddy/Caddyfile").is_file()


def test_the_reader_counts_what_aliases_expand_to_and_stops_at_its_limits(tmp_path: Path) -> None:
    """read_bounded_yaml refuses by counting libyaml's events, never by walking what was built:
    a bomb of 10^30 values is refused as fast as one of 10^9; the limits are exact (64 levels
    read, 65 refused) and anchors used as intended are read."""
    path = tmp_path / "f.yml"
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 30)]
    path.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(FleetError, match="aliases expand to more than 200000 values"):
        inventory_files.read_bounded_yaml(path)
    assert time.monotonic() - started < 2
    depth = inventory_files.MAX_YAML_DEPTH
    # The mapping is one level: 63 lists inside it are read, one more is not.
    path.write_text("a: " + "[" * (depth - 1) + "]" * (depth - 1) + "\n")
    node = inventory_files.read_bounded_yaml(path)["a"]
    for _ in range(depth - 2):
        [node] = node
    assert node == []
    path.write_text("a: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(FleetError, match=f"nested deeper than {depth} levels"):
        inventory_files.read_bounded_yaml(path)
    path.write_text("base: &b {ssh_user: root, card: rtx4090}\n"
                    + "".join(f"d{i}: *b\n" for i in range(inventory_files.MAX_YAML_ALIASES)))
    doc = inventory_files.read_bounded_yaml(path)
    assert doc["d999"] == {"ssh_user": "root", "card": "rtx4090"}
    path.write_text(path.read_text() + "one_more: *b\n")
    with pytest.raises(FleetError, match="more than 1000 aliases"):
        inventory_files.read_bounded_yaml(path)
