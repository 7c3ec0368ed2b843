"""Transformer blocks of the reference model: norms, attention (MHA/GQA, RoPE), MLP (GELU/SwiGLU).

Parameter names are stable across the switches (``ln1``, ``attn.qkv``, ``attn.proj``, ``ln2``,
``mlp.fc1``, ``mlp.fc2``): only shapes change, so dumps, checkpoints and tooling keep working.
"""

from __future__ import annotations

import torch
from torch import nn

from stalwart.models.config import GPTConfig, Normalization, RecomputeGranularity
from stalwart.models.functional import apply_rotary, causal_attention, mlp_activation
from stalwart.models.fused_grad import Linear
from stalwart.models.moe import MoEMLP
from stalwart.models.recompute import recomputed

Rope = tuple[torch.Tensor, torch.Tensor] | None


def make_norm(config: GPTConfig) -> nn.Module:
    """``nn.LayerNorm`` (weight and bias) or ``nn.RMSNorm`` (weight only) over the hidden size."""
    if config.normalization is Normalization.RMS_NORM:
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class CausalSelfAttention(nn.Module):
    """Causal self-attention: one fused QKV projection, optional RoPE, SDPA, output projection.

    ``qkv`` produces ``[q (heads*d) | k (groups*d) | v (groups*d)]`` per token; with
    ``groups == heads`` this is the GPT-2 layout. With selective recompute the attention core
    (RoPE and SDPA) runs again in backward (`stalwart.models.recompute`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_groups = config.query_groups
        self.head_dim = config.kv_channels
        self.dropout = config.dropout
        self.recompute_core = config.recompute_granularity is RecomputeGranularity.SELECTIVE
        kv_size = self.num_groups * self.head_dim
        h, bias = config.hidden_size, config.add_bias_linear
        self.qkv = Linear(h, h + 2 * kv_size, bias=bias)
        self.proj = Linear(h, h, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        b, s, h = x.shape
        kv_size = self.num_groups * self.head_dim
        q, k, v = self.qkv(x).split([h, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_groups, self.head_dim)
        v = v.view(b, s, self.num_groups, self.head_dim)
        cos, sin = rope if rope is not None else (None, None)
        if self.recompute_core:
            y = recomputed(self._core, q, k, v, cos, sin, preserve_rng_state=self.dropout > 0)
        else:
            y = self._core(q, k, v, cos, sin)
        return self.resid_dropout(self.proj(y.reshape(b, s, h)))

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[b, s, heads, d]`` attention output from ``[b, s, heads|groups, d]`` inputs."""
        if cos is not None and sin is not None:
            cos, sin = cos[: q.shape[1]].to(q.dtype), sin[: q.shape[1]].to(q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout_p = self.dropout if self.training else 0.0
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p)
        return y.transpose(1, 2)


class DenseMLP(nn.Module):
    """Two-layer MLP (GELU, or SwiGLU with ``[gate | up]`` from ``fc1``); returns ``(out,
    None)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_out = 2 * config.ffn_size if config.swiglu else config.ffn_size
        self.fc1 = Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.fc2 = Linear(config.ffn_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc2(mlp_activation(self.fc1(x), self.swiglu)), None


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    With ``bf16_residual_connection`` both branch outputs are added in bf16 (under autocast they
    already are; an fp32 branch, e.g. without autocast, is cast) so the stream stays bf16.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.residual_dtype = torch.bfloat16 if config.bf16_residual_connection else None
        self.ln1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln2 = make_norm(config)
        self.mlp: DenseMLP | MoEMLP
        if config.is_moe:
            self.mlp = MoEMLP(
                config.hidden_size,
                config.ffn_size,
                config.num_experts,
                config.moe_router_topk,
                config.moe_capacity_factor,
                swiglu=config.swiglu,
                bias=config.add_bias_linear,
            )
        else:
            self.mlp = DenseMLP(config)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, rope: Rope = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self._residual(self.attn(self.ln1(x), rope))
        mlp_out, aux_loss = self.mlp(self.ln2(x))
        return x + self._residual(self.mlp_dropout(mlp_out)), aux_loss

    def _residual(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_dtype is None else branch.to(self.residual_dtype)
