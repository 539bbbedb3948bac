"""The vllm-exl3 plugin: installed editable (pip install -e) and loadable as a vLLM plugin."""

from __future__ import annotations

from boxcheck import venv_json
from testinfra.host import Host

# The plugin's distribution name (normalised); vLLM loads it through this entry point group.
PLUGIN_DIST = "vllm-exl3"
GROUP = "vllm.general_plugins"

INSPECT = f"""
import importlib.metadata as md, json, re
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
dists = [d for d in md.distributions() if norm(d.metadata["Name"]) == {PLUGIN_DIST!r}]
out = {{"found": len(dists)}}
if dists:
    d = dists[0]
    direct = d.read_text("direct_url.json")
    out["direct_url"] = json.loads(direct) if direct else None
    out["entry_points"] = [[ep.name, ep.value] for ep in d.entry_points if ep.group == {GROUP!r}]
    out["errors"] = []
    for ep in d.entry_points:
        if ep.group == {GROUP!r}:
            try:
                ep.load()
            except Exception as exc:
                out["errors"].append(f"{{ep.name}} = {{ep.value}}: {{type(exc).__name__}}: {{exc}}")
print(json.dumps(out))
"""


def _plugin(host: Host, data: dict) -> dict:
    found = venv_json(host, data["venv_dir"], INSPECT, f"inspect {PLUGIN_DIST}")
    assert found["found"] == 1, f"{found['found']} distributions named {PLUGIN_DIST} in the venv"
    return found


def test_plugin_installed_editable(host: Host, data: dict) -> None:
    direct = _plugin(host, data)["direct_url"]
    assert direct, f"{PLUGIN_DIST} has no direct_url.json: not installed from a directory"
    assert direct.get("dir_info", {}).get("editable") is True, (
        f"{PLUGIN_DIST} is not an editable install: {direct}")


def test_plugin_entry_point_loads(host: Host, data: dict) -> None:
    found = _plugin(host, data)
    assert found["entry_points"], f"{PLUGIN_DIST} declares no {GROUP} entry point"
    assert not found["errors"], "entry point(s) failed to load:\n" + "\n".join(found["errors"])
