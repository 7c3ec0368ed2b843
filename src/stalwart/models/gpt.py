"""Reference decoder-only GPT (pre-LayerNorm, learned positions, tied embeddings, optional MoE).

The forward pass has no host syncs and no data-dependent shapes, so a full training iteration
can be captured in a CUDA graph or compiled with ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.moe import MoEMLP, MoERouter


def _require_int(value: object, flag: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model hyper-parameters; validated on construction (``ValueError`` naming the flag).

    ``ffn_hidden_size=None`` resolves to ``4 * hidden_size``. ``num_experts=0`` means a dense MLP;
    otherwise every layer's MLP is a top-``moe_router_topk`` mixture of ``num_experts`` experts with
    per-expert capacity ``ceil(moe_capacity_factor * topk * tokens / num_experts)``
    (``moe_capacity_factor=None``: no dropping). One ``dropout`` is used for embeddings,
    attention probabilities and residual branches (flag ``--hidden-dropout``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2
    moe_capacity_factor: float | None = 1.25
    init_std: float = 0.02
    layernorm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the Megatron flag of the first invalid field."""
        _require_int(self.num_layers, "--num-layers", 1)
        _require_int(self.hidden_size, "--hidden-size", 1)
        _require_int(self.num_attention_heads, "--num-attention-heads", 1)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must divide "
                f"--hidden-size ({self.hidden_size})"
            )
        _require_int(self.seq_length, "--seq-length", 1)
        _require_int(self.vocab_size, "--vocab-size", 1)
        _require_int(self.ffn_hidden_size, "--ffn-hidden-size", 1)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--hidden-dropout must be in [0, 1), got {self.dropout!r}")
        _require_int(self.num_experts, "--num-experts", 0)
        if self.num_experts > 0:
            if isinstance(self.moe_router_topk, bool) or not isinstance(self.moe_router_topk, int):
                raise ValueError(
                    f"--moe-router-topk must be an integer, got {self.moe_router_topk!r}"
                )
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"--moe-router-topk must be in [1, --num-experts={self.num_experts}], "
                    f"got {self.moe_router_topk}"
                )
        if not self.moe_aux_loss_coeff >= 0.0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff!r}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0.0:
            raise ValueError(
                "--moe-expert-capacity-factor must be > 0 or None (no dropping), "
                f"got {self.moe_capacity_factor!r}"
            )
        if not self.init_std > 0.0:
            raise ValueError(f"--init-method-std must be > 0, got {self.init_std!r}")
        if not self.layernorm_epsilon > 0.0:
            raise ValueError(f"--norm-epsilon must be > 0, got {self.layernorm_epsilon!r}")

    @property
    def ffn_size(self) -> int:
        """The resolved MLP hidden size (``ffn_hidden_size`` or ``4 * hidden_size``)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)))


class DenseMLP(nn.Module):
    """Two-layer GELU MLP; returns ``(output, None)`` to share the MoE interface."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_size)
        self.fc2 = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc2(F.gelu(self.fc1(x))), None


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp: DenseMLP | MoEMLP
        if config.is_moe:
            self.mlp = MoEMLP(
                config.hidden_size,
                config.ffn_size,
                config.num_experts,
                config.moe_router_topk,
                config.moe_capacity_factor,
            )
        else:
            self.mlp = DenseMLP(config)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.ln1(x))
        mlp_out, aux_loss = self.mlp(self.ln2(x))
        return x + self.mlp_dropout(mlp_out), aux_loss


class GPT(nn.Module):
    """Decoder-only GPT language model.

    ``forward(input_ids)`` returns logits ``[b, s, vocab_size]`` (model dtype).
    ``forward(input_ids, labels)`` returns a dict of tensors:

    * ``"loss"``: scalar to backprop = lm loss + ``moe_aux_loss_coeff`` * (sum over MoE layers of
      each layer's load-balancing loss), as Megatron adds one aux term per layer;
    * ``"lm loss"``: detached mean token cross entropy, computed on fp32 logits; labels equal to
      -100 are ignored (a batch with every label ignored gives NaN);
    * MoE only: ``"load balancing loss"``: detached per-layer mean of the aux loss
      (``num_experts * sum_i f_i * P_i``; 1.0 for perfectly balanced routing).

    Initialization is deterministic given torch's global seed: every weight ~ N(0, init_std),
    residual output projections ~ N(0, init_std / sqrt(2 * num_layers)), biases 0, LayerNorm 1/0.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if (".ln" in name or name.startswith("final_layernorm")) and leaf == "weight":
                nn.init.ones_(param)
            elif leaf == "bias" or leaf.endswith("_bias"):
                nn.init.zeros_(param)
            elif name.endswith(("proj.weight", "fc2.weight", "fc2_weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run the model on int64 ``input_ids`` [b, s] (s <= seq_length); see class docstring."""
        if input_ids.dim() != 2 or input_ids.shape[1] > self.config.seq_length:
            raise ValueError(
                f"input_ids must be [batch, s] with s <= --seq-length={self.config.seq_length}, "
                f"got shape {tuple(input_ids.shape)}"
            )
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_dropout(x)
        aux_losses: list[torch.Tensor] = []
        for layer in self.layers:
            x, aux = layer(x)
            if aux is not None:
                aux_losses.append(aux)
        x = self.final_layernorm(x)
        logits = F.linear(x, self.word_embeddings.weight)  # tied output embedding
        if labels is None:
            return logits
        lm_loss = F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        out = {"lm loss": lm_loss.detach()}
        if aux_losses:
            aux_sum = torch.stack(aux_losses).sum()
            out["loss"] = lm_loss + self.config.moe_aux_loss_coeff * aux_sum
            out["load balancing loss"] = (aux_sum / len(aux_losses)).detach()
        else:
            out["loss"] = lm_loss
        return out

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameter count (tied weights once); optionally without word+position embeddings."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.word_embeddings.weight.numel() + self.position_embeddings.weight.numel()
        return total

    def moe_routers(self) -> list[tuple[str, MoERouter]]:
        """``(qualified name, router)`` for every MoE router, in layer order (empty when dense)."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, MoERouter)]
