"""Does this run match the checkpoint it resumes from? Pure comparisons, flags named.

A checkpoint saved with other model shapes cannot be loaded: the user gets one line naming each
flag and both values before any tensor is read (instead of a DCP size-mismatch traceback deep in
the loader). Fields that do not change parameter shapes (dropout, init, MoE loss coefficient and
capacity, router top-k, epsilon, RoPE base, activation recompute) may change on purpose between
runs: they are reported, not refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# GPTConfig fields whose values fix parameter shapes (seq_length: learned position embeddings).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "ffn_hidden_size",
    "num_experts",
    # Llama switches: each changes which parameters exist or their shapes.
    "num_query_groups",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "normalization",
    "position_embedding_type",
)
# Flags whose spelling is not the field name.
_FLAG_OF = {
    "dropout": "--hidden-dropout",
    "add_bias_linear": "--disable-bias-linear",
    "layernorm_epsilon": "--norm-epsilon",
}


def flag_of(field_name: str) -> str:
    return _FLAG_OF.get(field_name, "--" + field_name.replace("_", "-"))


def model_config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """(refusals, notes): ``"--flag: checkpoint X, this run Y"`` for every differing field.

    Refusals are the shape fields; notes the rest. Fields missing on one side are ignored (older
    or newer checkpoints).
    """
    refusals: list[str] = []
    notes: list[str] = []
    for name in sorted(set(saved) & set(current)):
        if saved[name] == current[name]:
            continue
        line = f"{flag_of(name)}: checkpoint {saved[name]!r}, this run {current[name]!r}"
        (refusals if name in SHAPE_FIELDS else notes).append(line)
    return refusals, notes


def check_model_matches(
    common: Mapping[str, Any], current: Mapping[str, Any], log: Any = None
) -> None:
    """``ValueError`` naming every shape flag that differs from the checkpoint's ``common``
    (``common["config"]["model"]``); other differences go to ``log`` (a callable) if given."""
    saved = common.get("config", {}).get("model")
    if not isinstance(saved, Mapping):
        return  # a checkpoint without a recorded config: nothing to compare
    refusals, notes = model_config_differences(saved, current)
    if refusals:
        raise ValueError(
            "the checkpoint was saved with another model shape (pass the same flags, or start "
            "a new --save directory): " + "; ".join(refusals)
        )
    if notes and log is not None:
        log("resuming with changed model settings: " + "; ".join(notes))
