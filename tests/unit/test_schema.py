"""Issue 14's cases, each its own test: every value of defaults.yml, of a donor entry and of
`overrides` is checked (donorkit/inventory/schema.py) before anything renders or connects, and a
mistake is one line naming file, donor and field, exit 2, through `make render` and `pyinfra`
alike."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from donorkit.inventory.fleet import FleetError, load_fleet
from donorkit.inventory.paths import REPO_ROOT
from donorkit.inventory.pki import Pki, PkiError
from donorkit.inventory.values import owned_option
from donorkit.render.templates import render_host, render_unit
from tests.support.make import make

BIN = Path(sys.executable).parent
BOX = {"ssh_host": "192.0.2.10", "ssh_user": "root", "card": "rtx4090",
       "routes": {"hermes.ai.unturf.com": "qwen"}}


def donors(tmp_path: Path, box: dict | None = None, **extra: object) -> Path:
    """A donors file with one box (plus `extra` top-level keys), its PKI under tmp_path."""
    doc = {"overrides": {"pki_dir": str(tmp_path / "pki")}, "donors": {"box": box or BOX},
           **extra}
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


def with_overrides(tmp_path: Path, overrides: dict) -> Path:
    return donors(tmp_path, dict(BOX, overrides=overrides))


def refused(path: Path, field: str, problem: str = "") -> str:
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    assert f"field '{field}'" in message, message
    assert problem in message, message
    return message


# ------------------------------------------------------------------ overrides merge deeply ----

def test_one_field_of_a_profile_overridden(tmp_path: Path) -> None:
    box = load_fleet(with_overrides(tmp_path, {"models": {"qwen": {"port": 18887}}}))["box"]
    qwen = box.models["qwen"]
    assert qwen.port == 18887
    assert qwen.checkpoint == "turboderp/Qwen3.8-27B-exl3"  # the rest of the profile stays
    assert qwen.environment["VLLM_EXL3_BACKEND"] == "exllamav3"
    assert "--port 18887" in render_unit(box, qwen)


def test_one_field_of_a_card_and_one_env_value_overridden(tmp_path: Path) -> None:
    box = load_fleet(with_overrides(tmp_path, {
        "cards": {"rtx4090": {"cuda": "13.0"}},
        "unit_environment": {"EXTRA": "1"}}))["box"]
    assert box.cuda_home == "/usr/local/cuda-13.0" and box.card.arch == "8.9"
    assert box.unit_environment == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                       "MAX_JOBS": "2", "EXTRA": "1"}


def test_the_plugin_source_is_replaced_whole(tmp_path: Path) -> None:
    box = load_fleet(with_overrides(tmp_path, {"vllm_exl3_plugin": {
        "git_url": "https://example.com/vllm-exl3.git", "ref": "v1"}}))["box"]
    assert box.vllm_exl3_plugin.model_dump() == {
        "git_url": "https://example.com/vllm-exl3.git", "ref": "v1"}


def test_a_partial_new_profile_names_what_is_missing(tmp_path: Path) -> None:
    refused(with_overrides(tmp_path, {"models": {"llama": {"port": 18890}}}),
            "overrides.models.llama.checkpoint", "missing")


# ------------------------------------------------------------------ model args -------------------

@pytest.mark.parametrize("arg", ["--host=0.0.0.0", "--host", "--served_model_name",
                                 "--served-model-name=alias", "--port", "--port=1", "--hos",
                                 "--served", "--config", "--config=x.yaml", "--model",
                                 "--host.x"])
def test_args_cannot_set_what_the_deploy_owns(tmp_path: Path, arg: str) -> None:
    path = with_overrides(tmp_path, {"models": {"qwen": {"args": ["--max-num-seqs", arg]}}})
    refused(path, "overrides.models.qwen.args.1", "which the deploy owns")


@pytest.mark.parametrize("arg", ["--max-num-seqs", "--hf-token", "--model-impl", "--port-x",
                                 "0.0.0.0", "--seed=1", "-O3"])
def test_ordinary_args_pass(arg: str) -> None:
    assert owned_option(arg) is None


# ------------------------------------------------------------------ control characters --------

@pytest.mark.parametrize("overrides, field", [
    ({"unit_environment": {"X": "a\nUser=root"}}, "overrides.unit_environment.X"),
    ({"models": {"qwen": {"checkpoint": "a/b\nUser=root"}}}, "overrides.models.qwen.checkpoint"),
    ({"models": {"qwen": {"args": ["--x", "a\nUser=root"]}}}, "overrides.models.qwen.args.1"),
    ({"caddy_https_port": "443\n}\nevil.example.com {"}, "overrides.caddy_https_port"),
    ({"unit_service": {"MemoryMax": "16G\\"}}, "overrides.unit_service.MemoryMax"),
    ({"unit_service": {"User": "root"}}, "overrides.unit_service.User"),
])
def test_nothing_writes_its_own_lines(tmp_path: Path, overrides: dict, field: str) -> None:
    refused(with_overrides(tmp_path, overrides), field)


# ------------------------------------------------------------------ names and paths ------------

def test_a_donor_name_cannot_walk_out_of_pki(tmp_path: Path) -> None:
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump({"donors": {"../../../x": BOX}}))
    refused(path, "donors.../../../x", "is not a name")


@pytest.mark.parametrize("overrides, field", [
    ({"install_root": "opt/uncloseai"}, "overrides.install_root"),
    ({"venv_dir": "/opt/vllm venv"}, "overrides.venv_dir"),
    ({"venv_dir": "/opt/../etc"}, "overrides.venv_dir"),
    ({"cards": {"rtx4090": {"pip_index_url": "https://x.org/simple'; rm -rf /"}}},
     "overrides.cards.rtx4090.pip_index_url"),
    ({"cards": {"rtx4090": {"pip_extra_index_urls": ["--trusted-host x"]}}},
     "overrides.cards.rtx4090.pip_extra_index_urls.0"),
    ({"service_user": ["fox"]}, "overrides.service_user"),
    ({"service_user": "root"}, "overrides.service_user"),
    ({"service_user": "Fox; id"}, "overrides.service_user"),
    ({"models": {"Qwen!": {}}}, "overrides.models.Qwen!"),
    ({"exllamav3_ref": "--upload-pack=x"}, "overrides.exllamav3_ref"),
    ({"venv_build_packages": ["-e ."]}, "overrides.venv_build_packages.0"),
])
def test_paths_users_urls_and_names(tmp_path: Path, overrides: dict, field: str) -> None:
    refused(with_overrides(tmp_path, overrides), field)


# ------------------------------------------------------------------ ports and addresses -------

def test_two_models_on_one_port(tmp_path: Path) -> None:
    box = dict(BOX, routes={"a.example.com": "qwen", "b.example.com": "hermes"},
               overrides={"models": {"hermes": {"port": 18888}}})
    refused(donors(tmp_path, box), "models.qwen.port", "port 18888 is also models.hermes.port")


def test_a_model_on_caddys_port(tmp_path: Path) -> None:
    refused(with_overrides(tmp_path, {"models": {"qwen": {"port": 443}}}), "models.qwen.port",
            "also caddy_https_port")


@pytest.mark.parametrize("port", [0, 65536, 70000, -1, "18888", True, 18888.0])
def test_ports_are_ints_in_range(tmp_path: Path, port: object) -> None:
    refused(with_overrides(tmp_path, {"models": {"qwen": {"port": port}}}),
            "overrides.models.qwen.port")


@pytest.mark.parametrize("address", ["", "-oProxyCommand=touch /tmp/pwned", "a b", "a..b",
                                     "x" * 64 + ".example.com", 10])
def test_ssh_host_is_a_hostname_or_an_ip(tmp_path: Path, address: object) -> None:
    refused(donors(tmp_path, dict(BOX, ssh_host=address)), "ssh_host")


@pytest.mark.parametrize("address", ["gpu1", "gpu1.lan", "203.0.113.7", "2001:db8::7"])
def test_good_ssh_hosts(tmp_path: Path, address: str) -> None:
    assert load_fleet(donors(tmp_path, dict(BOX, ssh_host=address)))["box"].ssh_hostname == \
        address


def test_scrubbed_headers_must_be_a_list(tmp_path: Path) -> None:
    refused(with_overrides(tmp_path, {"caddy_log_scrubbed_headers": "Api-Key"}),
            "overrides.caddy_log_scrubbed_headers", "must be list")


def test_pki_renew_days_is_an_int(tmp_path: Path) -> None:
    refused(with_overrides(tmp_path, {"pki_renew_days": "30"}), "overrides.pki_renew_days",
            "must be int, got str '30'")


def test_defaults_file_is_checked_too(tmp_path: Path) -> None:
    defaults = yaml.safe_load((REPO_ROOT / "inventory/defaults.yml").read_text())
    defaults["caddy_https_port"] = "443"
    path = tmp_path / "defaults.yml"
    path.write_text(yaml.safe_dump(defaults))
    with pytest.raises(FleetError, match=rf"^{path}: field 'caddy_https_port': must be int"):
        load_fleet(donors(tmp_path), path)


def test_a_72_character_hostname_gets_a_certificate(tmp_path: Path) -> None:
    hostname = "x" * 60 + ".example.com"
    assert len(hostname) == 72
    box = load_fleet(donors(tmp_path, dict(BOX, routes={hostname: "qwen"})))["box"]
    files = {f.path: f.content for f in render_host(box)}
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(files["/etc/caddy/tls/box.crt"].encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [hostname]


def test_two_donors_may_route_one_hostname(tmp_path: Path) -> None:
    path = tmp_path / "donors.yml"
    path.write_text(yaml.safe_dump({"donors": {"a": BOX, "b": dict(BOX, ssh_host="192.0.2.11")}}))
    fleet = load_fleet(path)
    assert fleet["a"].routes == fleet["b"].routes


# ------------------------------------------------------------------ the CA ---------------------

@pytest.mark.parametrize("keep", ["ca.crt", "ca.key"])
def test_half_a_ca_pair_stops_and_nothing_is_written(tmp_path: Path, keep: str) -> None:
    pki = Pki(tmp_path / "pki")
    pki.server_cert("box", ["hermes.ai.unturf.com"])
    other = "ca.key" if keep == "ca.crt" else "ca.crt"
    (tmp_path / "pki" / other).unlink()
    kept = (tmp_path / "pki" / keep).read_bytes()
    with pytest.raises(PkiError, match=f"{keep} exists but .*{other} does not"):
        Pki(tmp_path / "pki").server_cert("box2", ["qwen.ai.unturf.com"])
    assert (tmp_path / "pki" / keep).read_bytes() == kept
    assert not (tmp_path / "pki" / other).exists()


def test_ca_files_are_never_overwritten(tmp_path: Path) -> None:
    """O_EXCL: a CA file that appears between the check and the write is not replaced."""
    from donorkit.inventory import pki as pki_module
    target = tmp_path / "ca.key"
    target.write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        pki_module._create_exclusive(target, b"ours", 0o600)
    assert target.read_bytes() == b"theirs"


# ------------------------------------------------------------------ entry points ---------------

BAD = textwrap.dedent("""\
    donors:
      box:
        ssh_host: 192.0.2.10
        ssh_user: root
        card: rtx4090
        routes: {hermes.ai.unturf.com: qwen}
        overrides: {models: {qwen: {args: [--host=0.0.0.0]}}}
""")


@pytest.mark.parametrize("entry", ["render", "pyinfra"])
def test_one_line_exit_2_through_make_render_and_pyinfra(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "donors.yml"
    path.write_text(BAD)
    env = dict(os.environ, DONORS_FILE=str(path))
    command = (make("render", "HOST=box", f"OUT={tmp_path / 'out'}") if entry == "render"
               else [str(BIN / "pyinfra"), "inventory/gpus.py", "debug-inventory"])
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    # Our one line; around it only make's own and pyinfra's progress lines.
    stderr = [line for line in result.stderr.splitlines()
              if line.strip() and not line.startswith(("make", "--> "))]
    # `donors` (what make render calls) says it as `donors: `; pyinfra's inventory file as before.
    prefix = "donors" if entry == "render" else "inventory error"
    assert stderr == [f"{prefix}: {path}: donor 'box': field "
                      "'overrides.models.qwen.args.0': '--host=0.0.0.0' would set --host, which "
                      "the deploy owns (--host 127.0.0.1, the model's port, no alias, no config "
                      "file)"], result.stderr
    assert result.returncode == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "pki").exists()


def test_half_ca_pair_stops_make_render(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()
    (pki / "ca.crt").write_text("kept")
    path = donors(tmp_path)
    result = subprocess.run([sys.executable, "-m", "donorkit.commands.render_cli", "box",
                             str(tmp_path / "out")], cwd=REPO_ROOT,
                            env=dict(os.environ, DONORS_FILE=str(path)), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pki error: {pki / 'ca.crt'} exists but {pki / 'ca.key'} does not: restore it (a new "
        "CA would break the edge's trust in every donor); nothing was written"]
    assert (pki / "ca.crt").read_text() == "kept" and not (pki / "ca.key").exists()


# ------------------------------------------------------------------ vLLM 0.26.0's own refusals --

def test_retention_is_refused_for_every_unit(tmp_path: Path) -> None:
    """vLLM 0.26.0 will not start a full-attention model (Hermes) with the retention variable:
    the file-wide environment cannot carry it."""
    refused(with_overrides(tmp_path, {"unit_environment": {
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "6400"}}),
        "overrides.unit_environment", "belongs in models.<name>.environment")


@pytest.mark.parametrize("value", ["-16", "64k", ""])
def test_retention_is_a_whole_number_of_tokens(tmp_path: Path, value: str) -> None:
    refused(with_overrides(tmp_path, {"models": {"qwen": {"environment": {
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": value}}}}),
        "overrides.models.qwen.environment", "must be a whole number of tokens")


RETENTION_ARGS = ["--enable-prefix-caching", "--mamba-cache-mode", "align"]


@pytest.mark.parametrize("value", ["6401", "4000"])  # 4000: a multiple of 16, not of 1600
def test_retention_is_a_multiple_of_the_profiles_block_size(tmp_path: Path, value: str) -> None:
    """The qwen profile gives --block-size 1600: vLLM's scheduler block, which the interval must
    divide into."""
    refused(with_overrides(tmp_path, {"models": {"qwen": {"environment": {
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": value}}}}),
        "overrides.models.qwen.environment", "a multiple of --block-size 1600")


def test_retention_block_size_in_either_spelling(tmp_path: Path) -> None:
    overrides = {"models": {"qwen": {"args": [*RETENTION_ARGS, "--block-size=1200"]}}}
    refused(with_overrides(tmp_path, overrides), "overrides.models.qwen.environment",
            "a multiple of --block-size 1200")
    overrides["models"]["qwen"]["args"][-1] = "--block-size=800"
    assert load_fleet(with_overrides(tmp_path, overrides))["box"].models["qwen"].environment[
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"] == "6400"


def test_retention_on_a_full_attention_profile_is_refused(tmp_path: Path) -> None:
    """Hermes (attention: full): vLLM 0.26.0 does not start it with the retention variable."""
    message = refused(with_overrides(tmp_path, {"models": {"hermes": {"environment": {
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "6400"}}}}),
        "overrides.models.hermes.environment", "on a full-attention profile (attention: full)")
    assert "donor 'box'" in message


@pytest.mark.parametrize("args", [
    ["--max-num-seqs", "12", "--block-size", "1600"],                      # not turned on
    [*RETENTION_ARGS, "--block-size", "1600", "--no-enable-prefix-caching"],  # turned off last
])
def test_retention_on_a_hybrid_needs_prefix_caching(tmp_path: Path, args: list[str]) -> None:
    refused(with_overrides(tmp_path, {"models": {"qwen": {"args": args}}}),
            "overrides.models.qwen.environment", "needs --enable-prefix-caching")


def test_retention_on_a_sliding_profile_uses_the_default_block(tmp_path: Path) -> None:
    """A sliding-window profile needs no prefix-caching flag; without --block-size the block is
    vLLM's default 16."""
    sliding = {"attention": "sliding", "args": ["--max-num-seqs", "12"]}
    box = load_fleet(with_overrides(tmp_path, {"models": {"qwen": sliding}}))["box"]
    assert box.models["qwen"].environment["VLLM_PREFIX_CACHE_RETENTION_INTERVAL"] == "6400"
    refused(with_overrides(tmp_path, {"models": {"qwen": {**sliding, "environment": {
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "6408"}}}}),
        "overrides.models.qwen.environment", "a multiple of the KV block size 16")


def test_the_attention_kind_is_one_of_three(tmp_path: Path) -> None:
    refused(with_overrides(tmp_path, {"models": {"hermes": {"attention": "linear"}}}),
            "overrides.models.hermes.attention", "full")


def test_the_shipped_profiles_say_their_attention() -> None:
    """The qwen profile keeps the seed's retention on the hybrid 27B with the flags vLLM needs for
    it; Hermes is full attention, without it."""
    defaults = yaml.safe_load((REPO_ROOT / "inventory/defaults.yml").read_text())["models"]
    assert defaults["qwen"]["attention"] == "hybrid"
    assert defaults["hermes"]["attention"] == "full"
    assert defaults["qwen"]["args"][-5:] == [*RETENTION_ARGS, "--block-size", "1600"]
    assert defaults["qwen"]["environment"]["VLLM_PREFIX_CACHE_RETENTION_INTERVAL"] == "6400"
    assert 6400 % 1600 == 0


def test_a_card_adds_its_flags_to_every_model(tmp_path: Path) -> None:
    box = load_fleet(with_overrides(tmp_path, {"cards": {"rtx4090": {
        "vllm_args": ["--attention-backend", "FLASHINFER"]}}}))["box"]
    for model in box.models.values():
        assert render_unit(box, model).splitlines()[-1].startswith("WantedBy")  # still a unit
        assert "--attention-backend FLASHINFER" in " ".join(
            line.strip(" \\") for line in render_unit(box, model).splitlines())


# ------------------------------------------------------------------ the hub over plain http ---

def test_a_token_never_goes_to_a_plain_http_hub(tmp_path: Path) -> None:
    """Issue 21, hole 2: the token would cross the network in clear. Refused at load, even with
    the test stand-in setting; plain http without a token only with that setting."""
    token = tmp_path / "hf-token"
    token.write_text("hf_x\n")
    refused(with_overrides(tmp_path, {"hf_endpoint": "http://hub.example:8080",
                                      "hf_token_file": str(token)}),
            "overrides.hf_endpoint", "plain http")
    refused(with_overrides(tmp_path, {"hf_endpoint": "http://hub.example:8080",
                                      "hf_token_file": str(token),
                                      "hf_endpoint_plain_http_test_standin": True}),
            "overrides.hf_token_file", "the token would cross the network in clear")
    refused(with_overrides(tmp_path, {"hf_endpoint": "http://hub.example:8080"}),
            "overrides.hf_endpoint", "hf_endpoint_plain_http_test_standin")
    box = load_fleet(with_overrides(tmp_path, {
        "hf_endpoint": "http://10.213.0.1:8089",
        "hf_endpoint_plain_http_test_standin": True}))["box"]
    assert box.hf_endpoint == "http://10.213.0.1:8089"
    box = load_fleet(with_overrides(tmp_path, {"hf_token_file": str(token)}))["box"]
    assert box.hf_endpoint.startswith("https://")
