"""Tiny random-weight checkpoints in the shape of each model profile, for the GPU harness that
starts the real vLLM 0.26.0 from the rendered units (gpu/engine_run.py).

STAND-INS for the real checkpoints: the GPU machine reaches no hub, and 27B/8B weights do not
travel in 64 MiB carries. What they say is noise; what vLLM does with them is what it does with
the real ones: the architecture is resolved, the KV cache groups are built (so vLLM's own checks
on the unit's environment run), the attention backend the unit's flags select is used, kernels
are JIT-compiled and autotuned, and the OpenAI server, chat template and tool parser run.

- qwen: the qwen profile's checkpoint (turboderp/Qwen3.8-27B-exl3) is a hybrid of linear-attention
  (Gated DeltaNet, a Mamba-type KV cache group) and full-attention layers; that is why the seed's
  Qwen unit can set VLLM_PREFIX_CACHE_RETENTION_INTERVAL, which vLLM 0.26.0 refuses for a model
  without sliding-window or Mamba layers. The stand-in is the same kind of hybrid in vLLM's
  Qwen3-Next architecture: three linear-attention layers and one full-attention layer, dense MLPs
  but for one expert layer (vLLM's Qwen3-Next needs one), head_dim 128. Plain fp16 weights: the
  unit's `--quantization exl3` needs the operator's own vllm-exl3 plugin, which is not in this
  repository (the harness drops that one flag and says so). Small linear-attention heads keep
  the recurrent state under 16 tokens of attention KV, so the scheduler's block stays 16 (the
  retention interval must be a multiple of it); two value heads per key head as in Qwen3-Next.
- qwen-dense: a plain Qwen3 (full attention only), the fallback the harness uses if the hybrid
  does not start; with it the retention variable must be dropped (recorded as such).
- hermes: Llama-3.1-shaped in AWQ format (4-bit, group 128, GEMM layout, zero points), so the
  hermes unit's exact flags run, `--quantization awq_marlin` and the hermes tool parser included.

Every checkpoint's max_position_embeddings is at least its profile's max_model_len. Deterministic
(fixed seeds). The tokenizer and chat template are the testbed's (tests/testbed/tiny_model.py:
byte-level, Qwen's <tool_call> tags, which Hermes-3 uses too).

    python gpu/tiny_checkpoints.py OUT_DIR     # needs torch and transformers (gpu/engine_carry.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.testbed.tiny_model import write_text_files

VOCAB = 512
MAX_POSITIONS = 65536  # >= qwen's 65536 and hermes' 64000 (defaults.yml max_model_len)

QWEN_HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    # Two value heads per key head, as Qwen3-Next has them (16 key heads, 32 value heads): with
    # one per key head vLLM 0.26.0's packed decode gets strided a/b views and dies ("`a`/`b`
    # must be contiguous in the last dim", seen on the H200: qwen_gdn_linear_attn.py reshapes
    # the interleaved layout into a view). Small heads keep a layer's recurrent state (about
    # 4.8 KiB) under 16 tokens of attention KV, so the scheduler's block stays 16 and the seed's
    # retention interval (6400) a multiple of it; vLLM's CuTe DSL decode kernel wants 128-wide
    # heads and falls back to its Triton one (a warning).
    "linear_num_key_heads": 1, "linear_num_value_heads": 2,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    # vLLM's Qwen3-Next wants at least one expert layer ("No Qwen3Next layer found in the
    # model.layers", seen on the H200): the last layer has 4 experts, 2 per token.
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [0, 1, 2], "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    "attention_bias": False, "torch_dtype": "float16", "bos_token_id": None,
}
QWEN_DENSE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "attention_bias": False, "use_sliding_window": False, "torch_dtype": "float16",
    "bos_token_id": None,
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
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items()
                                        if k not in ("architectures", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    tensors = {name: t.detach().to(torch.float32).numpy()
               for name, t in model.state_dict().items()}
    # The qwen unit runs --dtype float16.
    save_file({k: v.astype(np.float16) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


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
    "qwen": (QWEN_HYBRID, _transformers_checkpoint, 20261201),
    "qwen-dense": (QWEN_DENSE, _transformers_checkpoint, 20261202),
    "hermes": (HERMES_AWQ, _awq_llama, 20261203),
}


def write_all(out: Path) -> None:
    for name, (config, make, seed) in CHECKPOINTS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        write_text_files(folder, config)
        make(folder, config, seed)
        for path in folder.iterdir():
            path.chmod(0o644)  # read by the service user on the GPU machine


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python gpu/tiny_checkpoints.py OUT_DIR")
    write_all(Path(sys.argv[1]))
