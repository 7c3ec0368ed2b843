"""Mixture-of-experts MLP with a top-k softmax router and static-shape, capacity-based dispatch.

Every shape in this module depends only on tensor *shapes* (token count, number of experts,
capacity), never on tensor *values*, so the layer never syncs with the host and its whole
forward/backward can be captured in a CUDA graph or traced by ``torch.compile``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.functional import mlp_activation


class RoutingPlan(NamedTuple):
    """Where each (token, choice) assignment goes, in slot-major order (all first choices first).

    Attributes:
        combine_slot: int64 [k*T]; expert slot ``expert * capacity + position`` holding the
            assignment, or ``num_experts * capacity`` (a zero row) when it was dropped.
        slot_token: int64 [num_experts * capacity]; the token filling each slot, or ``T``
            (a zero row) for an empty slot.
        weights: fp32 [k*T]; router gate of the assignment, zero when it was dropped.
        aux_loss: fp32 scalar load-balancing loss (differentiable w.r.t. the router).
    """

    combine_slot: torch.Tensor
    slot_token: torch.Tensor
    weights: torch.Tensor
    aux_loss: torch.Tensor


def expert_capacity(
    num_tokens: int, num_experts: int, topk: int, capacity_factor: float | None
) -> int:
    """Static per-expert capacity: ``ceil(capacity_factor * topk * num_tokens / num_experts)``.

    ``capacity_factor=None`` means "never drop": an expert receives each token at most once, so
    ``num_tokens`` slots always suffice. The result is clamped to ``[1, num_tokens]``.
    """
    if capacity_factor is None:
        return num_tokens
    capacity = math.ceil(capacity_factor * topk * num_tokens / num_experts)
    return max(1, min(num_tokens, capacity))


class MoERouter(nn.Module):
    """Top-k softmax router computed in fp32, with Switch/GShard load-balancing loss.

    Observability buffers (device tensors, updated in place every forward without a host sync,
    not saved in the state dict):
      * ``last_tokens_per_expert``: int64 [num_experts], assignments per expert BEFORE capacity
        dropping; sums to ``topk * num_tokens``.
      * ``last_num_dropped_tokens``: int64 scalar, (token, expert) assignments dropped because the
        expert was over capacity.
    """

    last_tokens_per_expert: torch.Tensor
    last_num_dropped_tokens: torch.Tensor

    def __init__(
        self, hidden_size: int, num_experts: int, topk: int, capacity_factor: float | None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.topk = topk
        self.capacity_factor = capacity_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer(
            "last_tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.register_buffer(
            "last_num_dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> RoutingPlan:
        """Route ``x`` [T, hidden] and return the static-shape :class:`RoutingPlan`."""
        num_tokens = x.shape[0]
        num_experts, topk = self.num_experts, self.topk
        # The router runs in fp32 even under autocast: small logit differences decide routing.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            probs = torch.softmax(logits, dim=-1)
        top_probs, top_experts = torch.topk(probs, topk, dim=-1)  # [T, k]
        if topk > 1:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        # Slot-major order gives every token's first choice priority over any second choice.
        assign_expert = top_experts.t().reshape(-1)  # [k*T]
        onehot = torch.zeros(
            topk * num_tokens, num_experts, dtype=torch.int64, device=x.device
        ).scatter_(1, assign_expert.unsqueeze(1), 1)
        tokens_per_expert = onehot.sum(dim=0)
        position = (onehot.cumsum(dim=0) - 1).gather(1, assign_expert.unsqueeze(1)).squeeze(1)
        capacity = expert_capacity(num_tokens, num_experts, topk, self.capacity_factor)
        keep = position < capacity
        slot = assign_expert * capacity + position
        num_slots = num_experts * capacity
        arange_assign = torch.arange(topk * num_tokens, device=x.device)
        # Dropped assignments get private dump slots so every scatter index is unique
        # (unique indices keep the scatter deterministic on every backend).
        scatter_slot = torch.where(keep, slot, num_slots + arange_assign)
        token_of_assign = arange_assign % num_tokens
        slot_token = torch.full(
            (num_slots + topk * num_tokens,), num_tokens, dtype=torch.int64, device=x.device
        ).scatter_(0, scatter_slot, token_of_assign)[:num_slots]
        combine_slot = torch.where(keep, slot, torch.full_like(slot, num_slots))
        weights = top_probs.t().reshape(-1) * keep.to(top_probs.dtype)

        fraction_routed = tokens_per_expert.to(torch.float32) / float(topk * num_tokens)
        aux_loss = num_experts * torch.sum(fraction_routed * probs.mean(dim=0))

        self.last_tokens_per_expert.copy_(tokens_per_expert)
        self.last_num_dropped_tokens.copy_((~keep).sum())
        return RoutingPlan(combine_slot, slot_token, weights, aux_loss)


class MoEMLP(nn.Module):
    """``num_experts`` MLPs (GELU, or SwiGLU with ``swiglu``) behind a :class:`MoERouter`.

    Returns ``(output, aux_loss)``. Tokens dropped for capacity get a zero MLP output, so the
    residual stream passes them through unchanged. Output has the shape and dtype of the input.
    With ``swiglu`` each expert's first layer produces ``[gate | up]`` (``2 * ffn_hidden_size``).
    ``bias=False`` (``--disable-bias-linear``) leaves out the expert biases.
    """

    fc1_bias: nn.Parameter | None
    fc2_bias: nn.Parameter | None

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int,
        capacity_factor: float | None,
        swiglu: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.swiglu = swiglu
        fc1_out = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        self.router = MoERouter(hidden_size, num_experts, topk, capacity_factor)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, hidden_size, fc1_out))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        if bias:
            self.fc1_bias = nn.Parameter(torch.zeros(num_experts, 1, fc1_out))
            self.fc2_bias = nn.Parameter(torch.zeros(num_experts, 1, hidden_size))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the experts to ``x`` [..., hidden]; returns (output like x, fp32 aux loss)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        num_tokens, hidden = tokens.shape
        plan = self.router(tokens)
        padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
        expert_in = padded.index_select(0, plan.slot_token).view(self.num_experts, -1, hidden)
        h = mlp_activation(_batched_linear(expert_in, self.fc1_weight, self.fc1_bias), self.swiglu)
        expert_out = _batched_linear(h, self.fc2_weight, self.fc2_bias).reshape(-1, hidden)
        expert_out = torch.cat([expert_out, expert_out.new_zeros(1, hidden)])
        gathered = expert_out.index_select(0, plan.combine_slot).view(-1, num_tokens, hidden)
        gates = plan.weights.view(-1, num_tokens, 1).to(gathered.dtype)
        out = (gathered * gates).sum(dim=0)
        return out.reshape(shape), plan.aux_loss


def _batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Per-expert ``x[e] @ weight[e] (+ bias[e])``."""
    if bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(bias, x, weight)
