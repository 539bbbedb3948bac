"""A tiny Qwen3-architecture checkpoint made on the controller, for the real vLLM CPU engine.

STAND-IN for a real checkpoint (no GPU, no hub here): random weights, so what it says is noise,
but everything vLLM does with a real model happens: the config is parsed, the tokenizer and its
chat template (Qwen3's shape: tools, Hermes-style <tool_call> tags, `enable_thinking`) are loaded,
the safetensors are read, the KV cache is sized, tokens are generated and detokenized, and the
`hermes` tool-call parser finds its <tool_call>/</tool_call> tokens in the vocabulary.

Deterministic: the same files, byte for byte, on every run (fixed seed; no timestamps), so its
revision on the testbed's stand-in hub (hub_standin.py: a hash of the file list and blob ids) is
fixed too: tests/testbed/donors-cpu.yml pins it, and the deploy's weights step fetches it from
there as from the real hub. Made with numpy, safetensors and tokenizers only
(the controller's venv stays light: no torch).

The tokenizer is byte-level with no merges: one token per byte of text (plus the special tokens),
so a prompt's token count is known from its length (the acceptance run sizes long prompts by it).

    python -m tests.support.tiny_model OUT_DIR      # writes the checkpoint, prints its revision

write_variant makes checkpoints that are NOT this one, for the canary's wrong-model cases
(bench/canary_spread.py): another seed (another checkpoint of the same shape and tokenizer), this
one's weights with noise added (another revision), or another shape.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tests.support.hub_standin import load_repo

# The checkpoint's name as users see it in /v1/models (the hub id of the stand-in checkpoint).
MODEL_ID = "uncloseai-testbed/tiny-qwen3"
SEED = 20261130
# The transformer's shape. head_dim 32 or more (vLLM's CPU attention refused smaller before);
# tied embeddings, as small Qwen3 models have.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "torch_dtype": "float16",
    "bos_token_id": None,
}
# Special tokens of Qwen3's vocabulary that its chat template and vLLM's hermes parser use.
# `special` ones are dropped from decoded text; the tool-call tags must stay in it (the parser
# reads them), as in Qwen3's own tokenizer.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
EOS, PAD = "<|im_end|>", "<|endoftext|>"

# Qwen3's chat template, in its essentials: a system turn listing the tools with the Hermes
# <tool_call> instructions, assistant tool calls, tool results as <tool_response> in a user turn,
# and `enable_thinking=false` closing an empty <think></think> block in the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}
{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order: token id b is byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS
                    if not s])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, s in ADDED_TOKENS if s])
    return tok


def _weights(rng: np.random.Generator, c: dict = CONFIG) -> dict[str, np.ndarray]:
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    ones = lambda n: np.ones(n, dtype=np.float16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    return tensors


def write(out: Path) -> str:
    """Write the checkpoint into `out` (emptied first: the stand-in hub serves every file there);
    return its revision on the stand-in hub (40 hex digits)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_text_files(out, CONFIG)
    save_file(_weights(np.random.default_rng(SEED)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the files are public
    return revision(out)


def write_variant(out: Path, seed: int = SEED, noise: float = 0.0,
                  shape: dict | None = None) -> str:
    """A checkpoint other than the testbed's, written into `out` (emptied first): the weights of
    `seed` with the config's keys in `shape` changed, then `noise` times each tensor's RMS of
    Gaussian noise added (its own fixed seed: the same bytes every run). Returns its revision."""
    config = {**CONFIG, **(shape or {})}
    tensors = _weights(np.random.default_rng(seed), config)
    if noise:
        rng = np.random.default_rng((seed, 1))
        for name, value in tensors.items():
            exact = value.astype(np.float32)
            rms = float(np.sqrt(np.mean(exact * exact)))
            tensors[name] = (exact + rng.standard_normal(exact.shape) * noise * rms
                             ).astype(np.float16)
    if (seed, noise, shape) == (SEED, 0.0, None):
        raise ValueError("that is the testbed's own checkpoint: tiny_model.write makes it")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_text_files(out, config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    return revision(out)


def write_text_files(out: Path, config: dict) -> None:
    """Everything but the weights: the config (with the tokenizer's special ids), the generation
    config, the tokenizer and its chat template (also used by gpu/tiny_checkpoints.py)."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    config = {**config, "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    files = {
        "config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
        "generation_config.json": json.dumps({"eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
                                             indent=2, sort_keys=True) + "\n",
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
            "bos_token": None, "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False}, indent=2, sort_keys=True) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }
    for name, text in files.items():
        (out / name).write_text(text)


def revision(folder: Path) -> str:
    """The commit the stand-in hub serves the files in `folder` at (their names and blob ids)."""
    return load_repo(MODEL_ID, folder).commit


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.tiny_model OUT_DIR")
    print(write(Path(sys.argv[1])))
