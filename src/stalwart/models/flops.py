"""Model FLOPs per training iteration (Megatron convention) for MFU / throughput reporting."""

from __future__ import annotations

from stalwart.models.config import GPTConfig


def num_floating_point_operations(
    config: GPTConfig, batch_size: int, seq_length: int | None = None
) -> float:
    """FLOPs of one training iteration (forward + backward) over ``batch_size`` sequences.

    Only matmuls count, 2 FLOPs per multiply-add; backward costs 2x forward, so the total is
    3x forward (Megatron's ``E * F = 3 * 2``). With ``B = batch_size``, ``s = seq_length``
    (default ``config.seq_length``), ``L`` layers, hidden ``h``, query width ``q = heads * d = h``,
    key/value width ``kv = query_groups * d`` (``= h`` without GQA), MLP width ``F``, ``f_e = 3``
    with SwiGLU (gate, up, down) else 2, vocabulary ``V``, ``E`` experts, top-``k``::

        per_token_layer = 2*h*(q + 2*kv)     # QKV projection (GQA: smaller K and V)
                        + 2*s*q              # attention scores Q K^T, full s x s square
                        + 2*s*q              # attention-weighted values
                        + 2*q*h              # attention output projection
                        + k_eff*2*h*F*f_e    # MLP; k_eff = k for MoE (top-k experts), 1 dense
                        + 2*h*E              # MoE router (0 when dense)
        flops = 3 * B * s * (L * per_token_layer + 2*h*V)   # + logits layer

    These are Megatron's terms for SwiGLU, GQA and the untied output layer (one logits matmul,
    tied or not). Causal masking is ignored: the attention terms count the full square, as older
    Megatron did (Megatron's current formula halves them for causal attention). Dropped MoE
    tokens are counted as if processed; norms, softmax, activations, RoPE and embedding lookups
    are not counted.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--micro-batch-size/--global-batch-size must be >= 1, got {batch_size!r}")
    s = config.seq_length if seq_length is None else seq_length
    if s < 1:
        raise ValueError(f"--seq-length must be >= 1, got {s!r}")
    h, f, v = config.hidden_size, config.ffn_size, config.vocab_size
    q = h
    kv = config.query_groups * config.kv_channels
    experts_per_token = config.moe_router_topk if config.is_moe else 1
    router = 2 * h * config.num_experts if config.is_moe else 0
    gates = 3 if config.swiglu else 2
    attention = 2 * h * (q + 2 * kv) + 4 * s * q + 2 * q * h
    mlp = experts_per_token * 2 * h * f * gates + router
    forward = batch_size * s * (config.num_layers * (attention + mlp) + 2 * h * v)
    return float(3 * forward)
