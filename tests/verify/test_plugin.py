"""The vllm-exl3 plugin: installed editable (pip install -e) and loadable as a vLLM plugin."""

from __future__ import annotations

from boxcheck import missing, venv_json
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox

# vLLM loads plugins through this entry point group.
GROUP = "vllm.general_plugins"

INSPECT = """
import importlib.metadata as md, json, re
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
dists = [d for d in md.distributions() if norm(d.metadata["Name"]) == {dist!r}]
out = {"found": len(dists)}
if dists:
    d = dists[0]
    direct = d.read_text("direct_url.json")
    out["direct_url"] = json.loads(direct) if direct else None
    eps = [ep for ep in d.entry_points if ep.group == 'vllm.general_plugins']
    out["entry_points"] = [[ep.name, ep.value] for ep in eps]
    out["errors"] = []
    for ep in d.entry_points:
        if ep.group == 'vllm.general_plugins':
            try:
                ep.load()
            except Exception as exc:
                out["errors"].append(f"{ep.name} = {ep.value}: {type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


def _plugin(host: Host, data: DonorBox) -> dict:
    dist = data.vllm_exl3_plugin_dist
    found = venv_json(host, data.venv_dir, INSPECT.replace("{dist!r}", repr(dist)),
                      f"inspect {dist}")
    if found["found"] == 0:
        missing(host, f"no distribution named {dist} in {data.venv_dir}")
    assert found["found"] == 1, f"{found['found']} distributions named {dist} in the venv"
    return found


def test_plugin_installed_editable(host: Host, data: DonorBox) -> None:
    dist = data.vllm_exl3_plugin_dist
    direct = _plugin(host, data)["direct_url"]
    assert direct, f"{dist} has no direct_url.json: not installed from a directory"
    assert direct.get("dir_info", {}).get("editable") is True, (
        f"{dist} is not an editable install: {direct}")
    assert direct.get("url") == f"file://{data.vllm_exl3_plugin_dir}", (
        f"{dist} is installed from {direct.get('url')}, not {data.vllm_exl3_plugin_dir}")


def test_plugin_entry_point_loads(host: Host, data: DonorBox) -> None:
    found = _plugin(host, data)
    assert found["entry_points"], (
        f"{data.vllm_exl3_plugin_dist} declares no {GROUP} entry point")
    assert not found["errors"], "entry point(s) failed to load:\n" + "\n".join(found["errors"])
