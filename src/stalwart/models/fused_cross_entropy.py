"""The output layer and its cross entropy as one op (Megatron's ``--cross-entropy-loss-fusion``).

Unfused, the loss reads the ``[tokens, vocab]`` logits in the forward, keeps them for the
backward, reads them again there and writes a new tensor of the same size, the logits'
gradient. At gpt2-124m with 32 x 1024 tokens that is 3.3 GB per pass over the logits. Fused, as
Transformer Engine's cross entropy does for Megatron, the forward computes the loss and
overwrites the logits with their gradient in place (the loss is the last op before the
backward, so its gradient is known up to one scalar, the loss's own incoming gradient). The
backward then only runs the two GEMMs against the saved gradient. The logits cross memory once
in and once out, and no second ``[tokens, vocab]`` tensor exists.

The incoming gradient ``g`` (``1 / micro-batches``, times the loss scale under fp16) is a device
scalar, and applying it to the ``[tokens, vocab]`` gradient would cost the pass the fusion saves.
It is applied to the two small operands instead: ``grad_x = (G @ W) * g`` and
``grad_W = G^T @ (x * g)``. With ``g`` a power of two (1, 2, 4, 8 micro-batches) that is exact.

The op is a ``torch.library`` custom op: ``torch.compile`` calls it without a graph break and
without tracing into it, and a CUDA graph captures it (no host read: the count of labels that
are not ``ignore_index`` stays on the device). On CUDA the loss and gradient are one Triton
kernel (`stalwart.models.cross_entropy_triton`); elsewhere the same function in plain torch
(fp32, in row chunks). A label outside ``[0, vocab)`` that is not ``ignore_index`` gives a NaN
loss (the unfused loss raises, or asserts on CUDA). With gradient accumulation fusion
(``main_grad``) the weight's gradient is added into the fp32 ``main_grad`` as
`stalwart.models.fused_grad` does.

Example (the fused loss and gradients match the unfused ones)::

    >>> import torch
    >>> import torch.nn.functional as F
    >>> x = torch.randn(6, 4, requires_grad=True)
    >>> w = torch.randn(10, 4, requires_grad=True)
    >>> labels = torch.tensor([1, 2, -100, 9, 0, 3])
    >>> loss = linear_cross_entropy(x, w, labels)
    >>> loss.backward()
    >>> x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    >>> reference = F.cross_entropy(F.linear(x2, w2), labels)
    >>> reference.backward()
    >>> bool(torch.allclose(loss, reference) and torch.allclose(x.grad, x2.grad, atol=1e-6))
    True
    >>> bool(torch.allclose(w.grad, w2.grad, atol=1e-6))
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from stalwart.models.fused_grad import accumulate_wgrad

__all__ = ["linear_cross_entropy"]

# Rows per chunk of the plain-torch path: bounds its fp32 temporaries to a few chunks' worth.
_CHUNK_ELEMENTS = 1 << 24


def _loss_and_grad_reference(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """The kernel's contract in plain torch: per-row losses, ``logits`` overwritten with the
    gradient ``(softmax - one_hot) * scale`` (zero rows where ignored)."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        chunk, label = logits[start : start + step], labels[start : start + step]
        values = chunk.float()
        lse = torch.logsumexp(values, dim=-1)
        ignored = label == ignore_index
        in_range = (label >= 0) & (label < vocab)
        index = torch.where(in_range, label, 0).unsqueeze(1)
        target = values.gather(1, index).squeeze(1)
        nan = torch.full_like(lse, float("nan"))
        row_loss = torch.where(in_range, lse - target, nan)
        losses[start : start + step] = torch.where(ignored, torch.zeros_like(lse), row_loss)
        grad = torch.exp(values - lse.unsqueeze(1))
        hit = torch.where(in_range, -1.0, 0.0).to(grad.dtype).unsqueeze(1)
        grad.scatter_add_(1, index, hit)
        row_scale = torch.where(ignored, torch.zeros_like(lse), scale.expand_as(lse))
        chunk.copy_(grad * row_scale.unsqueeze(1))
    return losses


def _loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    if logits.device.type == "cuda":
        from stalwart.models.cross_entropy_triton import loss_and_grad_in_place

        return loss_and_grad_in_place(logits, labels, scale, ignore_index)
    return _loss_and_grad_reference(logits, labels, scale, ignore_index)


@torch.library.custom_op("stalwart::linear_cross_entropy", mutates_args=())
def _linear_ce(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean loss over the labels that are not ignore_index, its gradient w.r.t. the logits
    [tokens, vocab])``. The gradient is the logits' buffer, overwritten."""
    logits = x @ weight.t()
    counted = (labels != ignore_index).sum().to(torch.float32)
    # 1 / count on the device (no host read); 0 labels counted gives inf, and a NaN loss below.
    scale = (1.0 / counted).reshape(1)
    losses = _loss_and_grad(logits, labels, scale, ignore_index)
    return losses.sum() * scale[0], logits


@_linear_ce.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> Any:
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], weight.shape[0])


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    # The second output is never differentiated: no [tokens, vocab] zeros for its gradient.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_loss: torch.Tensor, _unused: Any) -> tuple[Any, ...]:
    x, weight, grad_logits = ctx.saved_tensors
    g = grad_loss.to(x.dtype)
    grad_x = (grad_logits @ weight) * g
    grad_weight = grad_logits.t() @ (x * g)
    return grad_x, grad_weight, None, None


_linear_ce.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("stalwart::linear_cross_entropy_accumulating", mutates_args=())
def _linear_ce_acc(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    main_grad: torch.Tensor,
    fp32_gemm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_linear_ce` whose weight gradient goes into ``main_grad`` (gradient accumulation
    fusion; ``main_grad`` is only written in the backward)."""
    loss, grad_logits = _linear_ce(x, weight, labels, ignore_index)
    return loss, grad_logits


@_linear_ce_acc.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    main_grad: Any,
    fp32_gemm: bool,
) -> Any:
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], weight.shape[0])


def _setup_acc(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _, _, main_grad, fp32_gemm = inputs
    ctx.save_for_backward(x, weight, output[1])
    # Not saved (version-checked): other ops add into it before this backward runs.
    ctx.main_grad = main_grad
    ctx.fp32_gemm = fp32_gemm
    ctx.set_materialize_grads(False)


def _backward_acc(ctx: Any, grad_loss: torch.Tensor, _unused: Any) -> tuple[Any, ...]:
    x, weight, grad_logits = ctx.saved_tensors
    g = grad_loss.to(x.dtype)
    accumulate_wgrad(grad_logits, x * g, ctx.main_grad, ctx.fp32_gemm)
    grad_x = (grad_logits @ weight) * g
    return grad_x, None, None, None, None, None


_linear_ce_acc.register_autograd(_backward_acc, setup_context=_setup_acc)


# torch's FLOP counter cannot see into the fused op: its forward's logits matmul is registered
# with torch's own formula registry, as the op's autograd is above, so every ``FlopCounterMode``
# (``stalwart.observability.flop_count``'s included) counts it. The backward's matmuls are plain
# ones, counted as such.
@register_flop_formula(
    [torch.ops.stalwart.linear_cross_entropy, torch.ops.stalwart.linear_cross_entropy_accumulating]
)
def _logits_matmul_flops(x: Any, weight: Any, *args: Any, **kwargs: Any) -> int:
    """The fused loss's forward: the ``[tokens, hidden] @ [hidden, vocab]`` matmul (shapes)."""
    return 2 * x[0] * x[1] * weight[0]


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    main_grad: torch.Tensor | None = None,
    fp32_wgrad: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight), labels, ignore_index=ignore_index)`` (the mean
    over the counted labels, fp32) with the loss's gradient computed in the forward.

    ``x``: ``[..., hidden]``; ``labels``: the matching ``[...]`` int64. Under autocast the
    matmul runs in the autocast dtype (``x`` and ``weight`` are cast, as for ``F.linear``);
    the loss is computed in fp32 from the logits in that dtype, as the unfused
    ``F.cross_entropy(logits.float(), ...)``; fp16 is refused (``ValueError``: the gradient,
    written before any loss scale, would underflow). ``main_grad``: the fp32 tensor the weight's
    gradient is added into (gradient accumulation fusion; ``weight`` then gets none;
    ``fp32_wgrad`` as in :func:`stalwart.models.fused_grad.linear_accumulating`).
    """
    dtype = weight.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    if dtype == torch.float16:
        # The gradient is written before the loss scale is applied: in fp16, (softmax -
        # one_hot) / tokens underflows (1e-5 / 32768 is below fp16's smallest subnormal).
        raise ValueError("--cross-entropy-loss-fusion needs bf16 or fp32 logits, not fp16")
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    targets = labels.reshape(-1)
    if main_grad is None:
        loss, _ = _linear_ce(rows, weight.to(dtype), targets, ignore_index)
    else:
        loss, _ = _linear_ce_acc(
            rows, weight.to(dtype), targets, ignore_index, main_grad, fp32_wgrad
        )
    return loss
