"""Model FLOPs per training iteration (Megatron convention) for MFU / throughput reporting."""

from __future__ import annotations

from stalwart.models.gpt import GPTConfig


def num_floating_point_operations(
    config: GPTConfig, batch_size: int, seq_length: int | None = None
) -> float:
    """FLOPs of one training iteration (forward + backward) over ``batch_size`` sequences.

    Only matmuls count, 2 FLOPs per multiply-add; backward costs 2x forward, so the total is
    3x forward. With ``B = batch_size``, ``s = seq_length`` (default ``config.seq_length``),
    ``L`` layers, hidden ``h``, MLP width ``F``, vocabulary ``V``, ``E`` experts, top-``k``::

        per_token_layer = 2*3*h*h        # QKV projection
                        + 2*s*h          # attention scores Q K^T, full s x s square (Megatron)
                        + 2*s*h          # attention-weighted values
                        + 2*h*h          # attention output projection
                        + k_eff*2*2*h*F  # MLP fc1 + fc2; k_eff = k for MoE (top-k experts), 1 dense
                        + 2*h*E          # MoE router (0 when dense)
        flops = 3 * B * s * (L * per_token_layer + 2*h*V)   # + logits layer

    Causal masking is ignored (full square, as Megatron counts it); dropped MoE tokens are
    counted as if processed; LayerNorm, softmax, GELU and embeddings lookups are not counted.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--micro-batch-size/--global-batch-size must be >= 1, got {batch_size!r}")
    s = config.seq_length if seq_length is None else seq_length
    if s < 1:
        raise ValueError(f"--seq-length must be >= 1, got {s!r}")
    h, f, v = config.hidden_size, config.ffn_size, config.vocab_size
    experts_per_token = config.moe_router_topk if config.is_moe else 1
    router = 2 * h * config.num_experts if config.is_moe else 0
    per_token_layer = 6 * h * h + 4 * s * h + 2 * h * h + experts_per_token * 4 * h * f + router
    forward = batch_size * s * (config.num_layers * per_token_layer + 2 * h * v)
    return float(3 * forward)
