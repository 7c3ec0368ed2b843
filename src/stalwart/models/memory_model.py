"""Theoretical peak memory of the reference GPT trained with AdamW (the formula behind memory.json).

Weights + optimizer, in bytes per parameter (stalwart's reference trainer keeps fp32 master
weights in place and runs bf16 autocast, so there is no separate bf16 parameter copy):

    bf16=True : fp32 param 4 + fp32 grad 4 + Adam m 4 + Adam v 4 + autocast bf16 weight copy 2 = 18
    bf16=False: fp32 param 4 + fp32 grad 4 + Adam m 4 + Adam v 4                                = 16
    sharded optimizer (Adam m, v sharded over DP): 10 + 8/DP (bf16) or 8 + 8/DP (fp32)

Megatron's layout (bf16 param 2 + fp32 grad 4 + fp32 main param 4 + m 4 + v 4) gives the same 18
unsharded and ``6 + 12/DP`` with its distributed optimizer. The autocast copy is counted because
``F.linear`` saves the bf16 weight for backward, so the copies live from forward until backward of
each micro-batch. Under full
recompute the recomputed layers' copies are not kept (autocast's cache is dropped when the forward
leaves autocast; the recompute casts again, one unit at a time).

Activations (bytes) of one micro-batch in flight: gradient accumulation frees each micro-batch's
activations in its own backward. Notation: t = b*s tokens, e = 2 (bf16 autocast) or 4 (fp32),
f = ffn size, f1 = 2f with SwiGLU else f (first MLP layer's width), n_h = heads, kv = key/value
width (query groups * head dim; h without GQA), V = vocab, E = experts, k = top-k, p = dropout,
N = norm input saved = 4h + 8 (LayerNorm: input, mean, rstd), 4h + 4 (RMSNorm, fused CUDA kernel:
input, rstd), 8h + 4 (RMSNorm composite on CPU: input, rstd, normalized). What
``stalwart.models.GPT`` saves for backward in eager PyTorch with flash/cuDNN SDPA (the residual
stream and norm outputs are fp32 because the norms run in fp32):

    attention part of a layer = t*(2N [both norms] + e*h [QKV input, autocast copy]
        + e*(h + 2kv) [QKV output; SDPA's k, v and (without RoPE) q are views of it]
        + e*(h + kv)*[RoPE] [rotated q, k] + e*h [SDPA output = proj input, a view]
        + h*[p>0] [residual-dropout mask]) + 4*b*n_h*s [logsumexp]
        fp32 with GQA (kv < h) repeats k, v for the memory-efficient kernel: instead of the QKV
        output and the rotated q, k, t*(e*(h*[RoPE] + 2h) + e*(h + 2kv)*[no RoPE])
    dense MLP                 = t*(e*h [fc1 input] + e*f1 [fc1 output] + e*f [activation output]
        + e*f*[SwiGLU] [silu(gate)] + h*[p>0])
    MoE MLP                   = t*(4h [router input, fp32] + 4E [softmax] + 24k [top-k, gates])
        + M*(e*h + e*f1 + e*f + e*f*[SwiGLU]) [expert input, fc1 out, activations]
        + e*k*t*h [gathered outputs] + t*h*[p>0], M = E * capacity (capacity =
        min(t, ceil(cf*k*t/E)), or t when cf is None)
    embedding                 = 16t [input ids, labels] + t*h*[p>0]
    head                      = t*N [final norm input] + e*t*h [lm-head input] + 4t*V [saved
                                log-softmax output, fp32]
    loss backward transient   = 8t*V [grad of the log-probs + grad of the fp32 logits, alive
                                together with the saved log-softmax output: the peak]
    with --cross-entropy-loss-fusion the head saves e*t*V (the logits' gradient, written over
        the logits in the forward) instead of 4t*V, and the transient is 2*e*t*h (the lm-head
        input scaled by the loss's incoming gradient, and its gradient): no [t, V] tensor is
        made in the backward (the CUDA kernel writes in place; the CPU path's fp32 temporaries,
        in row chunks of 2^24 values, are not counted)

Activation recompute (``stalwart.models.recompute``):

    selective: each layer saves e*t*(h + kv)*[RoPE] + 4*b*n_h*s less (the rotated q, k and the
        softmax statistics are recomputed; q, k, v and the output stay alive as the core's inputs
        and the projection's input)
    full: a recomputed unit (Megatron's uniform group, or one block-method layer) keeps 4*t*h (its
        fp32 input) instead of its layers' activations. Two moments can be the peak: the loss
        backward (as without recompute) and the backward of a recomputed unit, which holds that
        unit's recomputed activations and weight copies and what the units before it keep, while
        the head and the later layers are done; during that backward the hidden-state gradient
        4*t*h and the widest gradient, fc1's output e*t*f1 (M rows for MoE), are alive too.

    activation_bytes = max(L_kept*(attention + MLP) + stored unit inputs + embedding + head
                           + transient,  the recomputed-unit backward moment)
    total_bytes      = weights_optimizer_bytes + max(activation_bytes, optimizer transient)
                       + workspace_bytes
        optimizer transient = 4 bytes/param (foreach AdamW's sqrt(v) temporary; activations are
        freed by then)
        workspace_bytes = 64 MiB by default: the cuBLAS and cuBLASLt workspaces (32 MiB each on
        Hopper) that the caching allocator holds after the first matmul; pass 0 for CPU

bf16 compute weights (``--bf16-compute-weights``, ``stalwart.loop.ComputeWeights``) and the bf16
residual stream (``--bf16-residual-connection``):

    compute weights: the autocast copies are replaced by persistent bf16 copies of the slot
        parameters C (`compute_weight_parameters`: every Linear's weight and bias, the experts,
        and the output layer's use of tied embeddings; not the lookup, positions, norms, the MoE
        router): 2*C
        instead of 2*n, and full recompute does not drop them (they outlive the pass). Their
        bf16 gradients (2*C) live from the backward until the micro-batch's fp32 add: a moment
        at the end of each backward, when the activations are freed (compared, not added)
    bf16 residual: the stream between layers is bf16, so a recomputed unit keeps 2*t*h, and its
        backward moment's hidden-state gradient is 2*t*h; the norms' saved inputs stay fp32 on
        CUDA (autocast runs LayerNorm/RMSNorm in fp32 and saves the fp32 copy of a bf16 input:
        ``norms_upcast``), and are bf16 (2h) on CPU, whose autocast runs the norms in bf16

Assumes torch >= 2.5 for grouped-query attention (older torch repeats the key/value heads:
2*e*t*(h - kv) more per layer). Not counted: the CUDA context, allocator fragmentation (compare with
``mem-max-allocated-bytes``, not reserved), and the math SDPA backend (CPU with dropout) which
saves the [b, n_h, s, s] attention probabilities.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from stalwart.models.config import (
    GPTConfig,
    Normalization,
    PositionEmbeddingType,
    RecomputeGranularity,
)
from stalwart.models.recompute import LayerUnit, layer_units

MIB = 1 << 20
CUDA_WORKSPACE_BYTES = 64 * MIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Theoretical peak memory of one rank, in bytes.

    Attributes:
        weights_optimizer_bytes: parameters, gradients, Adam states, autocast weight copies held
            through backward.
        activation_bytes: saved activations of one micro-batch plus the backward transient, at
            the peak moment.
        total_bytes: weights_optimizer + max(activation, optimizer-step transient) + workspaces.
        num_parameters: parameters counted (experts included).
        bytes_per_parameter: nominal bytes per parameter (before the recompute adjustment).
        breakdown: named terms (bytes) of both parts, for the report.
    """

    weights_optimizer_bytes: float
    activation_bytes: float
    total_bytes: float
    num_parameters: int = 0
    bytes_per_parameter: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def bytes_per_parameter(dp_size: int, sharded_optimizer: bool, bf16: bool) -> float:
    """Weights+optimizer bytes per parameter for stalwart's layout (see the module docstring)."""
    replicated = 4.0 + 4.0 + (2.0 if bf16 else 0.0)
    adam = 8.0
    return replicated + (adam / dp_size if sharded_optimizer else adam)


def _norm_parameters(cfg: GPTConfig) -> int:
    return cfg.hidden_size * (1 if cfg.normalization is Normalization.RMS_NORM else 2)


def layer_parameters(cfg: GPTConfig) -> int:
    """Parameters of one transformer layer (attention, MLP or experts + router, two norms)."""
    h = cfg.hidden_size
    f = cfg.ffn_hidden_size or 4 * h
    f1 = 2 * f if cfg.swiglu else f
    kv = cfg.query_groups * cfg.kv_channels
    bias = 1 if cfg.add_bias_linear else 0
    attn = h * (h + 2 * kv) + bias * (h + 2 * kv) + h * h + bias * h
    mlp = h * f1 + bias * f1 + f * h + bias * h
    if cfg.num_experts > 0:
        mlp = cfg.num_experts * mlp + h * cfg.num_experts
    return attn + mlp + 2 * _norm_parameters(cfg)


def count_parameters(cfg: GPTConfig) -> int:
    """Parameters of the reference GPT for any combination of the architecture switches.

    Word embeddings ``V*h`` (twice when untied), learned positions ``s*h`` (not with RoPE),
    ``L`` layers of `layer_parameters`, the final norm. Pass the exact ``sum(p.numel() ...)`` to
    `theoretical_memory` when the model exists; this count is for planning before building it.
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    embeddings = v * h * (2 if cfg.untie_embeddings_and_output_weights else 1)
    if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE:
        embeddings += cfg.seq_length * h
    return embeddings + cfg.num_layers * layer_parameters(cfg) + _norm_parameters(cfg)


def _expert_slots(cfg: GPTConfig, tokens: int) -> int:
    """Rows the experts compute: num_experts * capacity, as ``stalwart.models.moe`` dispatches."""
    cf = cfg.moe_capacity_factor
    if cf is None:
        capacity = tokens
    else:
        capacity = max(
            1, min(tokens, math.ceil(cf * cfg.moe_router_topk * tokens / cfg.num_experts))
        )
    return cfg.num_experts * capacity


def compute_weight_parameters(cfg: GPTConfig) -> int:
    """Parameters with a bf16 compute copy under ``--bf16-compute-weights``
    (``stalwart.models.GPT.compute_weight_slots``): all but the input lookup of untied
    embeddings, learned positions, the norms and the MoE routers (the tied embedding's copy is
    the output's)."""
    h = cfg.hidden_size
    lookup = cfg.vocab_size * h if cfg.untie_embeddings_and_output_weights else 0
    positions = (
        cfg.seq_length * h
        if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE
        else 0
    )
    norms = (2 * cfg.num_layers + 1) * _norm_parameters(cfg)
    routers = cfg.num_layers * h * cfg.num_experts  # fp32, outside autocast (0 when dense)
    return count_parameters(cfg) - lookup - positions - norms - routers


def _residual_bytes(cfg: GPTConfig, bf16: bool) -> float:
    """Bytes per element of the residual stream between layers (2:
    ``--bf16-residual-connection``)."""
    return 2.0 if bf16 and cfg.bf16_residual_connection else 4.0


def _norm_saved(cfg: GPTConfig, fused_rms_norm: bool, input_bytes: float = 4.0) -> float:
    """Bytes per token a norm saves for backward (its input, fp32 unless the norm runs on a bf16
    stream without upcasting, plus statistics)."""
    h = cfg.hidden_size
    if cfg.normalization is Normalization.LAYER_NORM:
        return input_bytes * h + 8
    return input_bytes * h + 4 if fused_rms_norm else (input_bytes + 4.0) * h + 4


def _layer_bytes(
    cfg: GPTConfig, b: int, e: float, fused_rms_norm: bool, norm_input: float = 4.0
) -> tuple[float, float]:
    """(attention part, MLP part) saved by one layer without full recompute."""
    h, s = cfg.hidden_size, cfg.seq_length
    f = cfg.ffn_hidden_size or 4 * h
    f1 = 2 * f if cfg.swiglu else f
    kv = cfg.query_groups * cfg.kv_channels
    t = float(b * s)
    mask = t * h if cfg.dropout > 0 else 0.0
    rope = cfg.position_embedding_type is PositionEmbeddingType.ROPE
    lse = 4.0 * b * cfg.num_attention_heads * s
    qkv_out = e * (h + 2 * kv) * t  # SDPA's inputs are views of it
    core = e * (h + kv) * t * rope + lse  # RoPE out, logsumexp
    if cfg.query_groups < cfg.num_attention_heads and e > 2:
        # fp32 GQA repeats k, v (models.functional.GQA_KERNEL_DTYPES): SDPA saves the two copies
        # and the rotated q; the QKV output stays alive only through q's view without RoPE.
        qkv_out *= not rope
        core = e * (h * rope + 2 * h) * t + lse
    if cfg.recompute_granularity is RecomputeGranularity.SELECTIVE:
        core, qkv_out = 0.0, e * (h + 2 * kv) * t  # the recomputed core keeps its q, k, v inputs
    norms = 2 * _norm_saved(cfg, fused_rms_norm, norm_input)
    attn = t * (norms + e * h + e * h) + qkv_out + core + mask
    per_row = e * (h + f1 + f + (f if cfg.swiglu else 0))
    if cfg.num_experts > 0:
        k = cfg.moe_router_topk
        mlp = t * (4 * h + 4 * cfg.num_experts + 24 * k) + e * k * t * h
        mlp += _expert_slots(cfg, b * s) * per_row
    else:
        mlp = t * per_row
    return attn, mlp + mask


def _norm_input_bytes(cfg: GPTConfig, bf16: bool, norms_upcast: bool) -> float:
    return 4.0 if norms_upcast else _residual_bytes(cfg, bf16)


def activation_breakdown(
    cfg: GPTConfig,
    micro_batch_size: int,
    bf16: bool,
    fused_rms_norm: bool = True,
    norms_upcast: bool | None = None,
) -> dict[str, float]:
    """Named activation terms in bytes at the loss-backward moment (module docstring).
    ``norms_upcast`` (default ``fused_rms_norm``, i.e. CUDA): autocast runs the norms in fp32."""
    h, s, b = cfg.hidden_size, cfg.seq_length, micro_batch_size
    e = 2.0 if bf16 else 4.0
    t = float(b * s)
    norm_input = _norm_input_bytes(
        cfg, bf16, fused_rms_norm if norms_upcast is None else norms_upcast
    )
    attn, mlp = _layer_bytes(cfg, b, e, fused_rms_norm, norm_input)
    units = layer_units(cfg)  # type: ignore[arg-type]
    kept = sum(u.stop - u.start for u in units if not u.recompute)
    recomputed = sum(1 for u in units if u.recompute)
    mask = t * h if cfg.dropout > 0 else 0.0
    terms = {
        "layers.attention": kept * attn,
        "layers.mlp": kept * mlp,
        "embedding": 16 * t + mask,
        "head": t * _norm_saved(cfg, fused_rms_norm, norm_input)
        + e * t * h
        + _loss_saved(cfg, e, t),
        "loss_backward_transient": _loss_transient(cfg, e, t),
    }
    if recomputed:
        terms["layers.recompute_inputs"] = recomputed * _residual_bytes(cfg, bf16) * t * h
    return terms


def _loss_saved(cfg: GPTConfig, e: float, t: float) -> float:
    """What the loss keeps for backward: the fp32 log-softmax output, or fused
    (``cross_entropy_loss_fusion``) the logits' gradient written over the logits (compute dtype)."""
    return (e if cfg.cross_entropy_loss_fusion else 4.0) * t * cfg.vocab_size


def _loss_transient(cfg: GPTConfig, e: float, t: float) -> float:
    """The loss backward's transient: the log-probs' and fp32 logits' gradients; fused, only
    the lm-head input scaled by the incoming gradient and its gradient (``[t, h]`` each)."""
    if cfg.cross_entropy_loss_fusion:
        return 2.0 * e * t * cfg.hidden_size
    return 8.0 * t * cfg.vocab_size


def _recompute_backward_bytes(
    cfg: GPTConfig,
    micro_batch_size: int,
    bf16: bool,
    fused_rms_norm: bool,
    embedding: float,
    norm_input: float = 4.0,
    compute_weights: bool = False,
) -> float:
    """The largest backward moment of a recomputed unit (0 without full recompute).

    While unit ``u`` is recomputed and backwarded, the units before it still hold what they kept
    (their input, or their activations), the later ones are done. The recompute casts the
    unit's weights again (autocast), unless compute weights already hold them.
    """
    units: tuple[LayerUnit, ...] = layer_units(cfg)  # type: ignore[arg-type]
    if not any(u.recompute for u in units):
        return 0.0
    e = 2.0 if bf16 else 4.0
    attn, mlp = _layer_bytes(cfg, micro_batch_size, e, fused_rms_norm, norm_input)
    t = micro_batch_size * cfg.seq_length
    stream = _residual_bytes(cfg, bf16) * t * cfg.hidden_size
    stored_input = stream
    f = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    rows = _expert_slots(cfg, t) if cfg.num_experts > 0 else t
    # The hidden-state gradient (the stream's dtype) and the widest one in the layer (fc1's).
    grads = stream + e * rows * (2 * f if cfg.swiglu else f)
    before, worst = 0.0, 0.0
    for u in units:
        size = u.stop - u.start
        if u.recompute:
            recast = bf16 and not compute_weights
            copies = 2.0 * size * layer_parameters(cfg) if recast else 0.0
            moment = before + stored_input + size * (attn + mlp) + copies + grads
            worst = max(worst, moment)
        before += stored_input if u.recompute else size * (attn + mlp)
    return embedding + worst


def _check_estimate_args(
    micro_batch_size: int, dp_size: int, bf16: bool, compute_weights: bool
) -> None:
    if compute_weights and not bf16:
        raise ValueError("--bf16-compute-weights needs --bf16 (bf16 autocast)")
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")


def _weight_terms(
    config: GPTConfig,
    n: int,
    dp_size: int,
    sharded_optimizer: bool,
    bf16: bool,
    compute_weight_copies: int | None,
) -> tuple[float, float, dict[str, float]]:
    """The weights-and-optimizer bytes, bytes per parameter and their named terms.

    ``compute_weight_copies``: the parameters with persistent bf16 copies
    (``--bf16-compute-weights``, in place of autocast's), None without them.
    """
    bpp = bytes_per_parameter(dp_size, sharded_optimizer, bf16)
    adam = 8.0 / dp_size if sharded_optimizer else 8.0
    terms = {"params_fp32": 4.0 * n, "grads_fp32": 4.0 * n, "adam_states": adam * n}
    if compute_weight_copies is not None:
        terms["compute_weight_copies"] = 2.0 * compute_weight_copies
        weights = bpp * n - 2.0 * n + 2.0 * compute_weight_copies
        return weights, (weights / n if n else bpp), terms
    units = layer_units(config)  # type: ignore[arg-type]
    recomputed_params = layer_parameters(config) * sum(
        u.stop - u.start for u in units if u.recompute
    )
    # Recomputed units cast their weights again inside the recompute: not held across the pass.
    copies_dropped = 2.0 * recomputed_params if bf16 else 0.0
    terms["autocast_weight_copies"] = (2.0 if bf16 else 0.0) * n - copies_dropped
    return bpp * n - copies_dropped, bpp, terms


def _peak_activation(
    config: GPTConfig,
    micro_batch_size: int,
    bf16: bool,
    norms: tuple[bool, bool],
    copies: int | None,
    grad_accumulation_fusion: bool,
) -> tuple[float, dict[str, float]]:
    """The activation peak of one micro-batch and its breakdown terms: the larger of the
    forward's kept activations, a recomputed unit's backward moment and the compute copies'
    bf16 weight gradients (``norms``: fused RMSNorm, norms upcast; ``copies``: the compute
    copies' parameters, None without them)."""
    fused_rms_norm, upcast = norms
    acts = activation_breakdown(config, micro_batch_size, bf16, fused_rms_norm, upcast)
    terms = {f"activation.{k}": val for k, val in acts.items()}
    norm_input = _norm_input_bytes(config, bf16, upcast)
    compute_weights = copies is not None
    backward_unit = _recompute_backward_bytes(
        config,
        micro_batch_size,
        bf16,
        fused_rms_norm,
        acts["embedding"],
        norm_input,
        compute_weights,
    )
    if backward_unit:
        terms["activation_recompute_backward_moment"] = backward_unit
    # bf16 grads before the add
    grads_moment = 0.0 if grad_accumulation_fusion else 2.0 * (copies or 0)
    if grads_moment:
        terms["activation_compute_weight_grads_moment"] = grads_moment
    return max(sum(acts.values()), backward_unit, grads_moment), terms


def theoretical_memory(
    config: GPTConfig,
    micro_batch_size: int,
    dp_size: int,
    sharded_optimizer: bool = False,
    bf16: bool = True,
    num_parameters: int | None = None,
    workspace_bytes: float = CUDA_WORKSPACE_BYTES,
    fused_rms_norm: bool = True,
    compute_weights: bool = False,
    norms_upcast: bool | None = None,
    grad_accumulation_fusion: bool = False,
) -> MemoryEstimate:
    """Estimate one rank's peak memory for the reference GPT trained with AdamW.

    Args:
        config: the model; recompute settings included.
        micro_batch_size: sequences per micro-batch.
        dp_size: data-parallel size (only matters with ``sharded_optimizer``).
        sharded_optimizer: Adam states sharded over data-parallel ranks.
        bf16: bf16 autocast over fp32 weights (else pure fp32).
        num_parameters: exact parameter count; `count_parameters(config)` when ``None``.
        workspace_bytes: fixed library workspaces (cuBLAS/cuBLASLt on CUDA; 0 on CPU).
        fused_rms_norm: RMSNorm saves only its input and rstd (torch's fused CUDA kernel); False
            for the composite CPU implementation.
        compute_weights: ``--bf16-compute-weights`` (persistent bf16 copies; needs ``bf16``).
        norms_upcast: autocast runs the norms in fp32 (default ``fused_rms_norm``: CUDA); with
            ``bf16_residual_connection`` and False (CPU) the norms save their bf16 inputs.
        grad_accumulation_fusion: ``--gradient-accumulation-fusion``: the copies' weight
            gradients go straight into the fp32 grads (no bf16 gradient moment).
    """
    _check_estimate_args(micro_batch_size, dp_size, bf16, compute_weights)
    n = num_parameters if num_parameters is not None else count_parameters(config)
    upcast = fused_rms_norm if norms_upcast is None else norms_upcast
    copies = compute_weight_parameters(config) if compute_weights else 0
    weights, bpp, breakdown = _weight_terms(
        config, n, dp_size, sharded_optimizer, bf16, copies if compute_weights else None
    )
    activation, terms = _peak_activation(
        config,
        micro_batch_size,
        bf16,
        (fused_rms_norm, upcast),
        copies if compute_weights else None,
        grad_accumulation_fusion,
    )
    breakdown |= terms
    optimizer_transient = 4.0 * n / (dp_size if sharded_optimizer else 1)
    breakdown["optimizer_step_transient"] = optimizer_transient
    breakdown["library_workspaces"] = workspace_bytes
    return MemoryEstimate(
        weights_optimizer_bytes=weights,
        activation_bytes=activation,
        total_bytes=weights + max(activation, optimizer_transient) + workspace_bytes,
        num_parameters=n,
        bytes_per_parameter=bpp,
        breakdown=breakdown,
    )
