"""Named model presets (read-only) and ``preset_model_config`` to build a ``GPTConfig`` from one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from stalwart.models.config import GPTConfig

# The Llama architecture switches shared by the llama-* presets (Megatron's Llama recipes).
_LLAMA: dict[str, object] = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "add_bias_linear": False,
}

PRESETS: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {
        "tiny": MappingProxyType(
            {
                "num_layers": 2,
                "hidden_size": 256,
                "num_attention_heads": 4,
                "seq_length": 256,
                "vocab_size": 8192,
            }
        ),
        "small": MappingProxyType(
            {
                "num_layers": 6,
                "hidden_size": 512,
                "num_attention_heads": 8,
                "seq_length": 512,
                "vocab_size": 32768,
            }
        ),
        "gpt2-124m": MappingProxyType(
            {
                "num_layers": 12,
                "hidden_size": 768,
                "num_attention_heads": 12,
                "seq_length": 1024,
                "vocab_size": 50304,
            }
        ),
        # SwiGLU width ~ 8/3 h rounded up to a multiple of 64 (704 = 2.75 h),
        # GQA 4 heads : 2 groups.
        "llama-tiny": MappingProxyType(
            {
                "num_layers": 2,
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "ffn_hidden_size": 704,
                "seq_length": 256,
                "vocab_size": 8192,
                **_LLAMA,
            }
        ),
        # 152.8M parameters (77.3M of them the untied input and output embeddings); ffn = 8/3 h
        # exactly (2048, a multiple of 256), GQA 12 heads : 4 groups.
        "llama-150m": MappingProxyType(
            {
                "num_layers": 12,
                "hidden_size": 768,
                "num_attention_heads": 12,
                "num_query_groups": 4,
                "ffn_hidden_size": 2048,
                "seq_length": 1024,
                "vocab_size": 50304,
                **_LLAMA,
            }
        ),
        # Llama 3.2 1B (meta-llama/Llama-3.2-1B's config.json): 1,235,814,400 parameters, of
        # which 262.7M the word embeddings, tied to the output layer as Llama 3.2 1B ties them;
        # GQA 32 heads : 8 groups (head dim 64), SwiGLU 8192, RoPE base 500,000 with Llama 3's
        # scaling (factor 32), RMSNorm epsilon 1e-5, trained at 2048 tokens here.
        "llama-1b": MappingProxyType(
            {
                "num_layers": 16,
                "hidden_size": 2048,
                "num_attention_heads": 32,
                "num_query_groups": 8,
                "ffn_hidden_size": 8192,
                "seq_length": 2048,
                "vocab_size": 128256,
                "rotary_base": 500000,
                "use_rope_scaling": True,
                "rope_scaling_factor": 32.0,
                **_LLAMA,
                "untie_embeddings_and_output_weights": False,
            }
        ),
    }
)
"""Preset name -> read-only ``GPTConfig`` field values (other fields keep their defaults)."""

# llama-1b: 4 x 2048 tokens (a [8192, 128256] logits tensor per micro-batch).
PRESET_MICRO_BATCH_SIZE: Mapping[str, int] = MappingProxyType(
    {name: 4 if name == "llama-1b" else 8 for name in PRESETS}
)
"""Preset name -> default ``--micro-batch-size``."""


def preset_model_config(name: str, **overrides: object) -> GPTConfig:
    """Return a fresh ``GPTConfig`` for preset ``name`` with ``overrides`` applied on top.

    Raises ``ValueError`` naming ``--preset`` for an unknown name, listing the allowed ones, and
    for an override that is not a ``GPTConfig`` field; invalid values raise ``GPTConfig``'s own
    ``ValueError`` naming the offending flag.
    """
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"--preset {name}: unknown model override(s) {unknown}; allowed: {sorted(fields)}"
        )
    values: dict[str, object] = {**PRESETS[name], **overrides}
    return GPTConfig(**values)  # type: ignore[arg-type]
