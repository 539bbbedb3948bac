"""Tiny random-weight checkpoints in the shape of each model profile, for the GPU harness that
starts the real vLLM 0.26.0 from the rendered units (gpu/engine_run.py).

STAND-INS for the real checkpoints: the GPU machine reaches no hub, and 27B/8B weights do not
travel in 64 MiB carries. What they say is noise; what vLLM does with them is what it does with
the real ones: the architecture is resolved, the KV cache groups are built (so vLLM's own checks
on the unit's environment run), the attention backend the unit's flags select is used, kernels
are JIT-compiled and autotuned, and the OpenAI server, chat template and tool parser run.

- qwen: the qwen profile's checkpoint (turboderp/Qwen3.8-27B-exl3, Qwen3.5 generation) is
  `Qwen3_5ForConditionalGeneration`, which vLLM 0.26.0 serves as it is (its registry has no
  text-only Qwen3.5 class): a vision tower beside a hybrid language model of 64 layers, 48 Gated
  DeltaNet (a Mamba-type KV cache group) and 16 full attention, 3:1. The stand-in has the same
  class and the shapes that decide vLLM's kernels and its block arithmetic: attention head_dim 256
  with 4 KV heads, GDN key/value head dim 128 with 16 key and 48 value heads, the SSM state in
  float32, fp16 weights; the 3:1 pattern scaled to 8 layers (6 GDN, 2 attention); no expert
  layer (the 27B has none); small hidden and MLP sizes and a 2-layer vision tower, with the
  image/video processor files vLLM builds its multimodal input processing from. Its GDN state is
  then as many bytes per layer as the 27B's, so the qwen unit's `--block-size 1600` is what vLLM
  aligns to, as on the real model. Plain fp16 weights: the unit's `--quantization exl3` needs the
  operator's own vllm-exl3 plugin, which is not in this repository (the harness drops that flag).
- qwen-next: the fallback the harness uses if qwen does not start: the same text shapes in vLLM's
  Qwen3-Next architecture (a text-only hybrid), which needs one expert layer (vLLM's Qwen3-Next:
  "No Qwen3Next layer found in the model.layers", seen on the H200): the last one.
- hermes: Llama-3.1-shaped in AWQ format (4-bit, group 128, GEMM layout, zero points), so the
  hermes unit's exact flags run, `--quantization awq_marlin` and the hermes tool parser included.

Every checkpoint's max_position_embeddings is at least its profile's max_model_len. Deterministic
(fixed seeds). The tokenizer and chat template are the testbed's (tests/support/tiny_model.py:
byte-level, Qwen's <tool_call> tags, which Hermes-3 uses too).

    python gpu/tiny_checkpoints.py OUT_DIR     # needs torch and transformers (gpu/engine_carry.py)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.tiny_model import write_text_files

VOCAB = 512
MAX_POSITIONS = 65536  # >= qwen's 65536 and hermes' 64000 (defaults.yml max_model_len)

# The 27B's text shapes that vLLM's kernels and block arithmetic see (DESIGN.md "Facts for the
# Qwen unit"); hidden and MLP sizes small.
QWEN_TEXT = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 8, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                        "mrope_section": [11, 11, 10]},
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float16",
    "bos_token_id": None,
}
QWEN35 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {**QWEN_TEXT, "model_type": "qwen3_5_text"},
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64,
                      "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": []},
    "tie_word_embeddings": False, "torch_dtype": "float16",
}
# Vision special tokens (Qwen's names), added to the testbed tokenizer for the qwen stand-in.
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
QWEN_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    **{k: v for k, v in QWEN_TEXT.items() if k not in ("rope_parameters", "mamba_ssm_dtype")},
    "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": list(range(7)), "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256, "norm_topk_prob": True,
}
HERMES_AWQ = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "torch_dtype": "float16", "bos_token_id": None,
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": True, "version": "gemm"},
}
AWQ_GROUP, AWQ_PACK = 128, 8  # 8 four-bit values per int32


def _transformers_checkpoint(out: Path, config: dict, seed: int) -> None:
    """Random weights in exactly the shapes and names transformers gives the architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items()
                                        if k not in ("architectures", "torch_dtype")})
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    model = auto.from_config(hf_config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    tensors = {name: t.detach().to(torch.float32).numpy()
               for name, t in model.state_dict().items()}
    # The qwen unit runs --dtype float16.
    save_file({k: v.astype(np.float16) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


def _qwen35(out: Path, config: dict, seed: int) -> None:
    """The multimodal Qwen3.5 checkpoint: the testbed tokenizer plus Qwen's vision tokens (their
    ids in the config), the image and video processor files in the hub's Qwen3-VL format, which
    vLLM's Qwen3-VL input processing loads (small images: the encoder's profiling stays small),
    then the weights."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS.values()])
    tok.save(str(out / "tokenizer.json"), pretty=True)
    ids = {key: tok.token_to_id(text) for key, text in VISION_TOKENS.items()}
    assert max(ids.values()) < VOCAB
    settings = json.loads((out / "config.json").read_text())
    settings |= ids
    for key in ("eos_token_id", "pad_token_id"):  # write_text_files put them at the top level
        settings["text_config"][key] = settings[key]
    (out / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
              "processor_class": "Qwen3VLProcessor"}
    for name, extra in (("preprocessor_config.json",
                         {"image_processor_type": "Qwen2VLImageProcessorFast"}),
                        ("video_preprocessor_config.json",
                         {"video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
                          "min_frames": 4, "max_frames": 8})):
        (out / name).write_text(json.dumps({**common, **extra}, indent=2, sort_keys=True) + "\n")
    _transformers_checkpoint(out, settings, seed)


def _awq_linear(rng: np.random.Generator, prefix: str, n_in: int, n_out: int) -> dict:
    """AWQ GEMM layout: qweight [in, out/8] and qzeros [in/128, out/8] int32, scales [in/128, out]
    fp16; zero point 8 in every nibble, small scales (weights of about +-0.016)."""
    groups = n_in // AWQ_GROUP
    return {
        f"{prefix}.qweight": rng.integers(-2**31, 2**31, (n_in, n_out // AWQ_PACK),
                                          dtype=np.int64).astype(np.int32),
        f"{prefix}.qzeros": np.full((groups, n_out // AWQ_PACK), 0x88888888 - 2**32,
                                    dtype=np.int32),
        f"{prefix}.scales": np.full((groups, n_out), 0.002, dtype=np.float16),
    }


def _awq_llama(out: Path, config: dict, seed: int) -> None:
    rng = np.random.default_rng(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, h), "lm_head.weight": rand(VOCAB, h),
               "model.norm.weight": np.ones(h, np.float16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.input_layernorm.weight": np.ones(h, np.float16),
                    f"{p}.post_attention_layernorm.weight": np.ones(h, np.float16)}
        for name, n_in, n_out in (("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv),
                                  ("self_attn.v_proj", h, kv), ("self_attn.o_proj", q, h),
                                  ("mlp.gate_proj", h, inter), ("mlp.up_proj", h, inter),
                                  ("mlp.down_proj", inter, h)):
            tensors |= _awq_linear(rng, f"{p}.{name}", n_in, n_out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


CHECKPOINTS = {
    "qwen": (QWEN35, _qwen35, 20261201),
    "qwen-next": (QWEN_NEXT, _transformers_checkpoint, 20261202),
    "hermes": (HERMES_AWQ, _awq_llama, 20261203),
}


def write_all(out: Path) -> None:
    for name, (config, make, seed) in CHECKPOINTS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        write_text_files(folder, config if "text_config" not in config else
                         {**config, "max_position_embeddings": MAX_POSITIONS})
        make(folder, config, seed)
        for path in folder.iterdir():
            path.chmod(0o644)  # read by the service user on the GPU machine


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python gpu/tiny_checkpoints.py OUT_DIR")
    write_all(Path(sys.argv[1]))
