"""Stateless pieces of the reference model: rotary embeddings, MLP activations, attention core.

Everything here depends only on tensor shapes, never on tensor values, so it runs inside a
captured CUDA graph and under ``torch.compile`` without host syncs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

# ``F.scaled_dot_product_attention(enable_gqa=...)`` exists from torch 2.5; before that the key and
# value heads are repeated (more memory, same result).
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"
# Only the flash kernel (half precision) reads shared key/value heads; in fp32 ``enable_gqa``
# falls back to the math kernel, which keeps the [s, s] probabilities of every head for backward
# (measured on the H200: llama-150m fp32 peaked 37% above the estimate). Repeating the heads
# keeps the memory-efficient kernel: two [s, heads*d] copies instead of the [s, s] matrices.
GQA_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


# Llama 3.x RoPE scaling (Megatron's and Meta's constants): the context the frequencies were
# trained for, and the wavelengths (in units of it) where scaling starts and ends.
ROPE_SCALING_CONTEXT = 8192
ROPE_SCALING_LOW_FREQ_FACTOR = 1.0
ROPE_SCALING_HIGH_FREQ_FACTOR = 4.0


def llama3_scaled_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x frequency scaling: channels whose wavelength exceeds ``8192 / 1`` tokens turn
    ``factor`` times slower, those under ``8192 / 4`` keep their frequency, and those between
    move linearly (in ``8192 / wavelength``) from one to the other."""
    wavelength = 2 * math.pi / inv_freq
    context, low, high = (
        ROPE_SCALING_CONTEXT,
        ROPE_SCALING_LOW_FREQ_FACTOR,
        ROPE_SCALING_HIGH_FREQ_FACTOR,
    )
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1.0 - blend) * inv_freq / factor + blend * inv_freq


def rotary_tables(
    head_dim: int, seq_length: int, base: float, scaling_factor: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[seq_length, head_dim]`` for rotate-half RoPE.

    Channel ``i`` and ``i + head_dim/2`` rotate together at frequency ``base^(-2i/head_dim)``
    (Megatron's non-interleaved layout), scaled as Llama 3.x does when ``scaling_factor`` is
    given (:func:`llama3_scaled_frequencies`). Computed in float64 so long sequences keep their
    angles.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling_factor is not None:
        inv_freq = llama3_scaled_frequencies(inv_freq, scaling_factor)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, s, heads, d]`` by the angles of ``cos``/``sin`` ``[s, d]`` (x's dtype).

    Autograd saves only ``cos`` and ``sin`` (constants), not ``x``.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def mlp_activation(x: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """GELU, or SwiGLU on ``x = [gate | up]`` (last dim ``2 * ffn``): ``silu(gate) * up``."""
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """Causal SDPA of ``q`` ``[b, heads, s, d]`` over ``k``/``v`` ``[b, groups, s, d]``.

    ``groups`` divides ``heads`` (grouped-query attention when smaller). In half precision with
    torch >= 2.5 the flash kernel reads the shared key/value heads directly; otherwise they are
    repeated (see ``GQA_KERNEL_DTYPES``).
    """
    heads, groups = q.shape[1], k.shape[1]
    if groups == heads:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if SDPA_HAS_GQA and q.dtype in GQA_KERNEL_DTYPES:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=True
        )
    repeat = heads // groups
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
