"""The reference GPT's weights under Hugging Face ``LlamaForCausalLM`` names (``stalwart export
--format hf``).

A Llama-architecture `GPTConfig` (RoPE, RMSNorm, SwiGLU, no biases, dense MLP: the ``llama-*``
presets) is the same function as ``transformers``' Llama: the fused ``attn.qkv`` splits into
``q_proj | k_proj | v_proj``, ``mlp.fc1`` into ``gate_proj | up_proj``, and RoPE is the same
rotate-half layout with the same frequencies (Llama 3.x scaling as ``rope_scaling``). Pure functions of the config and the state dict::

    >>> from stalwart.models import GPT, preset_model_config
    >>> cfg = preset_model_config("llama-tiny", num_layers=1, hidden_size=32, vocab_size=64,
    ...                           num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48)
    >>> hf = hf_llama_state(cfg, GPT(cfg).state_dict())
    >>> sorted(hf)[:3]
    ['lm_head.weight', 'model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
    >>> tuple(hf["model.layers.0.self_attn.k_proj.weight"].shape)
    (16, 32)
    >>> hf_llama_config(cfg)["num_key_value_heads"]
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stalwart.models.config import GPTConfig, Normalization
from stalwart.models.functional import (
    ROPE_SCALING_CONTEXT,
    ROPE_SCALING_HIGH_FREQ_FACTOR,
    ROPE_SCALING_LOW_FREQ_FACTOR,
)


def llama_incompatibility(config: GPTConfig) -> str | None:
    """Why ``config`` is not a Llama architecture (None when it is)."""
    problems = []
    if not config.uses_rope:
        problems.append("learned positions (Llama: --position-embedding-type rope)")
    if config.normalization is not Normalization.RMS_NORM:
        problems.append("LayerNorm (Llama: --normalization RMSNorm)")
    if not config.swiglu:
        problems.append("a GELU MLP (Llama: --swiglu)")
    if config.add_bias_linear:
        problems.append("biases (Llama: --disable-bias-linear)")
    if config.is_moe:
        problems.append("experts (Llama is dense)")
    return "; ".join(problems) or None


def hf_llama_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` of the equivalent ``LlamaForCausalLM`` (``ValueError`` if there is none)."""
    problem = llama_incompatibility(config)
    if problem is not None:
        raise ValueError(f"not a Llama architecture: {problem}")
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": float(config.rotary_base),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_std,
        "torch_dtype": "float32",
    }
    if config.use_rope_scaling:
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(config.rope_scaling_factor),
            "low_freq_factor": ROPE_SCALING_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_SCALING_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": ROPE_SCALING_CONTEXT,
        }
    return hf


def hf_llama_state(config: GPTConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a `GPT` state dict of a Llama-architecture ``config``) under HF Llama names;
    contiguous tensors of their own (safetensors stores no views)."""
    hf_llama_config(config)  # refuses a non-Llama architecture
    h, kv = config.hidden_size, config.query_groups * config.kv_channels
    out = {"model.embed_tokens.weight": state["word_embeddings.weight"]}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "attn.qkv.weight"].split([h, kv, kv], dim=0)
        gate, up = state[src + "mlp.fc1.weight"].chunk(2, dim=0)
        out.update({
            dst + "input_layernorm.weight": state[src + "ln1.weight"],
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": state[src + "attn.proj.weight"],
            dst + "post_attention_layernorm.weight": state[src + "ln2.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": state[src + "mlp.fc2.weight"],
        })  # fmt: skip
    out["model.norm.weight"] = state["final_layernorm.weight"]
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {name: t.detach().clone().contiguous() for name, t in out.items()}
