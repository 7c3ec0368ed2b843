"""The Llama-switch and recompute flags -> ``GPTConfig`` overrides (on top of the preset).

Unset flags keep the preset's value. Flags that would do nothing in the resulting model are
refused instead of ignored (``ValueError`` naming the flag): ``--num-query-groups`` without
grouped-query attention, ``--rotary-base`` without RoPE, ``--rope-scaling-factor`` without
``--use-rope-scaling``. Value checks are ``GPTConfig``'s.
"""

from __future__ import annotations

import argparse
from typing import Any

from stalwart.models import PRESETS, GPTConfig

# flag dest -> GPTConfig field, for the flags whose value is passed through unchanged
_PASS_THROUGH = {
    "position_embedding_type": "position_embedding_type",
    "rotary_base": "rotary_base",
    "use_rope_scaling": "use_rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "normalization": "normalization",
    "norm_epsilon": "layernorm_epsilon",
    "swiglu": "swiglu",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "recompute_granularity": "recompute_granularity",
    "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
    "bf16_residual_connection": "bf16_residual_connection",
    "cross_entropy_loss_fusion": "cross_entropy_loss_fusion",
}


def architecture_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """``GPTConfig`` field overrides from the architecture and recompute flags in ``ns``."""
    preset = PRESETS.get(ns.preset, {})
    overrides: dict[str, Any] = {
        field: getattr(ns, dest)
        for dest, field in _PASS_THROUGH.items()
        if getattr(ns, dest, None) is not None
    }
    disable_bias = getattr(ns, "disable_bias_linear", None)
    if disable_bias is not None:
        if not isinstance(disable_bias, bool):
            raise ValueError(f"--disable-bias-linear is a switch, got {disable_bias!r}")
        overrides["add_bias_linear"] = not disable_bias
    overrides.update(_query_groups(ns, preset))
    position = overrides.get("position_embedding_type", preset.get("position_embedding_type"))
    if "rotary_base" in overrides and position != "rope":
        raise ValueError("--rotary-base needs --position-embedding-type rope")
    scaling = overrides.get("use_rope_scaling", preset.get("use_rope_scaling", False))
    if "rope_scaling_factor" in overrides and not scaling:
        raise ValueError("--rope-scaling-factor needs --use-rope-scaling")
    return overrides


def _query_groups(ns: argparse.Namespace, preset: Any) -> dict[str, Any]:
    """``num_query_groups`` as Megatron reads ``--group-query-attention --num-query-groups N``
    (default 1 group); a preset with GQA keeps its groups unless the flag is given."""
    gqa, groups = getattr(ns, "group_query_attention", None), getattr(ns, "num_query_groups", None)
    if gqa is not None and not isinstance(gqa, bool):
        raise ValueError(f"--group-query-attention is a switch, got {gqa!r}")
    preset_gqa = preset.get("num_query_groups") is not None
    if groups is not None and not (gqa or preset_gqa):
        raise ValueError("--num-query-groups needs --group-query-attention")
    if groups is not None:
        return {"num_query_groups": groups}
    if gqa and not preset_gqa:
        return {"num_query_groups": 1}
    return {}


def check_megatron_model_flags(ns: argparse.Namespace, model: GPTConfig) -> None:
    """Megatron's flags whose value stalwart's model derives: each given one must agree with
    ``model``, else ``ValueError`` naming it (a value that differs would be a different model
    than the script describes)."""
    max_pos = getattr(ns, "max_position_embeddings", None)
    if max_pos is not None:
        if max_pos < model.seq_length:  # Megatron's own rule
            raise ValueError(
                f"--max-position-embeddings ({max_pos}) must be >= --seq-length "
                f"({model.seq_length}), as in Megatron"
            )
        if not model.uses_rope and max_pos != model.seq_length:
            raise ValueError(
                f"--max-position-embeddings {max_pos} differs from --seq-length "
                f"{model.seq_length}: stalwart's learned position table has --seq-length rows "
                f"(Megatron's would have {max_pos}); pass --max-position-embeddings "
                f"{model.seq_length} or drop it"
            )
    kv = getattr(ns, "kv_channels", None)
    if kv is not None and kv != model.kv_channels:
        raise ValueError(
            f"--kv-channels {kv}: stalwart's head size is --hidden-size / --num-attention-heads "
            f"= {model.kv_channels}"
        )
    attention = getattr(ns, "attention_dropout", None)
    if attention is not None and attention != model.dropout:
        raise ValueError(
            f"--attention-dropout {attention} differs from --hidden-dropout {model.dropout}: "
            "stalwart has one dropout probability (--hidden-dropout) for embeddings, attention "
            "probabilities and residual branches; give both the same value"
        )
    multiple = getattr(ns, "make_vocab_size_divisible_by", None)
    if multiple is not None and model.vocab_size % multiple:
        padded = -(-model.vocab_size // multiple) * multiple
        raise ValueError(
            f"--make-vocab-size-divisible-by {multiple}: Megatron would pad the vocabulary from "
            f"{model.vocab_size} to {padded}; stalwart does not pad: pass --vocab-size {padded}"
        )
