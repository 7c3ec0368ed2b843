"""Megatron's own memory formulas (``megatron.training.theoretical_memory_usage``), for comparison
with stalwart's estimate (`stalwart.models.memory_model`); nothing here is used for the
estimate itself."""

from __future__ import annotations

from stalwart.models.config import RecomputeGranularity
from stalwart.models.memory_model import GPTShape


def megatron_bytes_per_parameter(dp_size: int, distributed_optimizer: bool) -> float:
    """Megatron's formula: 18 without the distributed optimizer, else 6 + 12/DP."""
    return 6.0 + 12.0 / dp_size if distributed_optimizer else 18.0


def megatron_activation_bytes(
    cfg: GPTShape, micro_batch_size: int, sequence_parallel: bool = False
) -> float:
    """Megatron's ``compute_activation_memory`` (TP = PP = 1), for comparison only.

    Megatron uses Korthikanti et al.'s selective formula ``s*b*h*(18 + 4f/h)`` per layer only with
    sequence parallelism and selective recompute, and otherwise ``s*b*h*34`` per layer times
    1.05, whatever the recompute setting (it overestimates full recompute).
    """
    s, b, h, v = cfg.seq_length, micro_batch_size, cfg.hidden_size, cfg.vocab_size
    f = cfg.ffn_hidden_size or 4 * h
    sbh = float(s * b * h)
    embedding = 8.0 * s * b + sbh
    if sequence_parallel and cfg.recompute_granularity is RecomputeGranularity.SELECTIVE:
        per_layer = sbh * (18 + 4 * f / h)
        return cfg.num_layers * per_layer + embedding + sbh * 4 * (1 + v / h)
    per_layer = sbh * (10 + 24)
    return (cfg.num_layers * per_layer + embedding + (s * b * v + sbh) * 2) * 1.05
