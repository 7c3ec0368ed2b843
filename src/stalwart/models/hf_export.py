"""The reference GPT's weights under Hugging Face names (``stalwart export --format hf``):
``GPT2LMHeadModel`` for the GPT-2 architecture, ``LlamaForCausalLM`` for the Llama one.

A GPT-2-architecture `GPTConfig` (learned positions, LayerNorm, a GELU MLP, multi-head attention:
the default, ``tiny``, ``small`` and ``gpt2-124m`` presets) is the same function as
``transformers``' GPT-2 with ``activation_function="gelu"``: the reference GPT's GELU is the exact
(erf) one, which is transformers' ``"gelu"``; OpenAI's GPT-2 used the tanh approximation
(``"gelu_new"``), so an OpenAI checkpoint and this export differ in that one function. GPT-2's
``Conv1D`` layers store ``[in, out]``, the transpose of ``nn.Linear``'s ``[out, in]``; the fused
``attn.qkv`` is already GPT-2's ``c_attn`` layout (``q | k | v``, heads contiguous). Without
biases (``--disable-bias-linear``) the export writes zero biases, which GPT-2 adds exactly.

A Llama-architecture `GPTConfig` (RoPE, RMSNorm, SwiGLU, no biases, dense MLP: the ``llama-*``
presets) is the same function as ``transformers``' Llama: the fused ``attn.qkv`` splits into
``q_proj | k_proj | v_proj``, ``mlp.fc1`` into ``gate_proj | up_proj``, and RoPE is the same
rotate-half layout with the same frequencies (Llama 3.x scaling as ``rope_scaling``). Pure functions
of the config and the state dict::

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
    >>> gpt2 = preset_model_config("tiny", num_layers=1, hidden_size=32, vocab_size=64)
    >>> config, state = hf_config_and_state(gpt2, GPT(gpt2).state_dict())
    >>> config["architectures"], config["activation_function"]
    (['GPT2LMHeadModel'], 'gelu')
    >>> tuple(state["transformer.h.0.attn.c_attn.weight"].shape)  # Conv1D: [in, out]
    (32, 96)
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
        out.update(
            {
                dst + "input_layernorm.weight": state[src + "ln1.weight"],
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "attn.proj.weight"],
                dst + "post_attention_layernorm.weight": state[src + "ln2.weight"],
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "mlp.fc2.weight"],
            }
        )
    out["model.norm.weight"] = state["final_layernorm.weight"]
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


# GPT-2's <|endoftext|>: transformers' GPT2Config default for bos/eos, kept where it is a token.
_GPT2_EOS = 50256


def gpt2_incompatibility(config: GPTConfig) -> str | None:
    """Why ``config`` is not a GPT-2 architecture (None when it is)."""
    problems = []
    if config.uses_rope:
        problems.append("RoPE (GPT-2: --position-embedding-type learned_absolute)")
    if config.normalization is not Normalization.LAYER_NORM:
        problems.append("RMSNorm (GPT-2: --normalization LayerNorm)")
    if config.swiglu:
        problems.append("a SwiGLU MLP (GPT-2: GELU, no --swiglu)")
    if config.query_groups != config.num_attention_heads:
        problems.append("grouped-query attention (GPT-2: no --num-query-groups)")
    if config.is_moe:
        problems.append("experts (GPT-2 is dense)")
    return "; ".join(problems) or None


def hf_gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` of the equivalent ``GPT2LMHeadModel`` (``ValueError`` if there is none)."""
    problem = gpt2_incompatibility(config)
    if problem is not None:
        raise ValueError(f"not a GPT-2 architecture: {problem}")
    eos = _GPT2_EOS if config.vocab_size > _GPT2_EOS else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_size,
        "n_positions": config.seq_length,
        "n_ctx": config.seq_length,
        "activation_function": "gelu",  # exact GELU (erf), as F.gelu; GPT-2's own is "gelu_new"
        "layer_norm_epsilon": config.layernorm_epsilon,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_std,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def hf_gpt2_state(config: GPTConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a `GPT` state dict of a GPT-2-architecture ``config``) under HF GPT-2 names:
    linear weights transposed to ``Conv1D``'s ``[in, out]``, zero biases where the model has
    none; the tied output layer is ``transformer.wte`` (no ``lm_head.weight`` of its own)."""
    hf_gpt2_config(config)  # refuses a non-GPT-2 architecture
    out = {
        "transformer.wte.weight": state["word_embeddings.weight"],
        "transformer.wpe.weight": state["position_embeddings.weight"],
    }
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[dst + theirs + ".weight"] = state[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = state[src + ours + ".bias"]
        for ours, theirs in (
            ("attn.qkv", "attn.c_attn"),
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc1", "mlp.c_fc"),
            ("mlp.fc2", "mlp.c_proj"),
        ):
            weight = state[src + ours + ".weight"]
            bias = state.get(src + ours + ".bias")
            if bias is None:  # --disable-bias-linear: GPT-2 adds zeros, exactly
                bias = weight.new_zeros(len(weight))
            out[dst + theirs + ".weight"] = weight.t()
            out[dst + theirs + ".bias"] = bias
    out["transformer.ln_f.weight"] = state["final_layernorm.weight"]
    out["transformer.ln_f.bias"] = state["final_layernorm.bias"]
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def hf_config_and_state(
    config: GPTConfig, state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, state under HF names)`` of the transformers model that computes what
    ``config`` does: ``GPT2LMHeadModel`` or ``LlamaForCausalLM``. ``ValueError`` (one line,
    naming what stands in the way of each) when neither does."""
    gpt2, llama = gpt2_incompatibility(config), llama_incompatibility(config)
    if gpt2 is None:
        return hf_gpt2_config(config), hf_gpt2_state(config, state)
    if llama is None:
        return hf_llama_config(config), hf_llama_state(config, state)
    raise ValueError(
        f"no transformers model computes this architecture: not GPT-2 ({gpt2}); not Llama ({llama})"
    )
