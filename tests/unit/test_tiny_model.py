"""The testbed's generated checkpoint: the same bytes every run (so the revision the real-engine
host's data pins), delivered by the stand-in hub through the weights step's program, a tokenizer
that vLLM's hermes parser can use, and a chat template that renders tools and
`enable_thinking: false`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jinja2
import pytest
import yaml
from huggingface_hub import try_to_load_from_cache
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from donorkit.inventory.paths import REPO_ROOT
from tests.support import tiny_model
from tests.support.hub_standin import make_servers

DONORS_CPU = REPO_ROOT / "tests/testbed/donors-cpu.yml"


def test_same_files_and_revision_every_run(tmp_path: Path) -> None:
    one = tiny_model.write(tmp_path / "a")
    two = tiny_model.write(tmp_path / "b")
    assert one == two and len(one) == 40
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name
    (tmp_path / "b" / "config.json").write_text("{}")
    assert tiny_model.revision(tmp_path / "b") != one


def test_config_and_weights_agree(tmp_path: Path) -> None:
    tiny_model.write(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] >= 32
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"],
                                                          config["hidden_size"])
    heads = config["num_attention_heads"] * config["head_dim"]
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (heads,
                                                                       config["hidden_size"])
    assert len({k.split(".")[2] for k in tensors if k.startswith("model.layers.")}) == \
        config["num_hidden_layers"]
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() <= config["vocab_size"]
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")



def test_variants_are_other_checkpoints_with_the_same_tokenizer(tmp_path: Path) -> None:
    """The canary's wrong models (bench/canary_spread.py): another seed, the same weights with
    noise, another shape; each its own revision, the same tokenizer, the same bytes every run."""
    own = tiny_model.write(tmp_path / "own")
    base = load_file(str(tmp_path / "own/model.safetensors"))
    seen = {own}
    for name, kw in {"seed": {"seed": tiny_model.SEED + 1}, "noise": {"noise": 0.01},
                     "shape": {"seed": 7, "shape": {"num_hidden_layers": 3}}}.items():
        rev = tiny_model.write_variant(tmp_path / name, **kw)
        assert rev == tiny_model.write_variant(tmp_path / f"{name}-again", **kw), name
        assert rev not in seen, name
        seen.add(rev)
        assert (tmp_path / name / "tokenizer.json").read_bytes() == \
            (tmp_path / "own/tokenizer.json").read_bytes()
        tensors = load_file(str(tmp_path / name / "model.safetensors"))
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["num_hidden_layers"] == (3 if name == "shape" else 2)
        if name == "noise":  # the same weights, 1% of each tensor's RMS apart
            for key, value in base.items():
                diff = tensors[key].astype("float32") - value.astype("float32")
                rms = float((value.astype("float32") ** 2).mean() ** 0.5)
                assert 0.005 * rms < float((diff ** 2).mean() ** 0.5) < 0.02 * rms, key
    with pytest.raises(ValueError, match="the testbed's own checkpoint"):
        tiny_model.write_variant(tmp_path / "x")


def test_tokenizer_bytes_and_tool_tags(tmp_path: Path) -> None:
    tiny_model.write(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "héllo <tool_call>\n{\"a\": 1}\n</tool_call>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    # One token per byte, the tool tags one token each (vLLM's hermes parser looks them up).
    assert tok.token_to_id("<tool_call>") in enc.ids
    assert len(enc.ids) == len(text.encode()) - len("<tool_call></tool_call>") + 2
    ids = tok.encode("<|im_start|>x<|im_end|>").ids
    assert tok.decode(ids, skip_special_tokens=True) == "x"


def _render(tmp_path: Path, **kw) -> str:
    env = jinja2.Environment()
    return env.from_string((tmp_path / "chat_template.jinja").read_text()).render(**kw)


def test_chat_template_tools_and_thinking(tmp_path: Path) -> None:
    tiny_model.write(tmp_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "Weather?"}]
    out = _render(tmp_path, messages=messages, tools=tools, add_generation_prompt=True,
                  enable_thinking=False)
    assert out.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in out and "<tool_call>" in out
    assert out.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
                        "<think>\n\n</think>\n\n")
    plain = _render(tmp_path, messages=messages, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}]}
    turn = _render(tmp_path, messages=[*messages, call,
                                       {"role": "tool", "content": "sunny"}])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>' in turn
    assert "<tool_response>\nsunny\n</tool_response>" in turn


def test_the_real_engine_hosts_pinned_revision_is_the_generators(tmp_path: Path) -> None:
    """donors-cpu.yml pins the commit the stand-in hub serves the generated files at."""
    pinned = yaml.safe_load(DONORS_CPU.read_text())["overrides"]["models"]["tiny"]["revision"]
    assert tiny_model.write(tmp_path / tiny_model.MODEL_ID) == pinned


def test_fetched_from_the_standin_hub_by_the_weights_program(tmp_path: Path) -> None:
    """What the deploy's weights step does on tb-cpu, on loopback: the real huggingface_hub
    client (files/fetch_weights.py) gets every file at the pinned revision, byte for byte, and
    the offline lookup vLLM makes with --revision (HF_HUB_OFFLINE) finds them in the cache."""
    hub_root = tmp_path / "hub"
    rev = tiny_model.write(hub_root / tiny_model.MODEL_ID)
    server, cdn, _ = make_servers("127.0.0.1", 0, 0, tmp_path, hub_root)
    for s in (server, cdn):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    cache = tmp_path / "home/hub"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    try:
        out = subprocess.run(
            [sys.executable, str(REPO_ROOT / "files/fetch_weights.py"), "--repo",
             tiny_model.MODEL_ID, "--revision", rev, "--cache-dir", str(cache),
             "--manifest-dir", str(tmp_path / "home/manifests"), "--endpoint",
             f"http://127.0.0.1:{server.server_address[1]}"],
            capture_output=True, text=True, timeout=120, env=env)
    finally:
        for s in (server, cdn):
            s.shutdown()
            s.server_close()
    assert out.returncode == 0, out.stderr
    assert "weights: done, 6 files" in out.stdout, out.stdout
    for path in (hub_root / tiny_model.MODEL_ID).iterdir():
        found = try_to_load_from_cache(tiny_model.MODEL_ID, path.name, cache_dir=cache,
                                       revision=rev)
        assert isinstance(found, str) and Path(found).read_bytes() == path.read_bytes(), path.name
