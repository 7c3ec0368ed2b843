"""Gradient accumulation fusion (Megatron's ``--gradient-accumulation-fusion``).

With bf16 compute weights (`stalwart.loop.ComputeWeights`) every micro-batch's backward writes
each weight's gradient in bf16 and a foreach add then folds it into the fp32 ``.grad``: the
gradient is written, read and the fp32 gradient read and written again. Fused, the weight
gradient GEMM accumulates straight into the fp32 ``.grad`` (cuBLAS with an fp32 output and
``beta = 1``: Megatron's ``wgrad_gemm_accum_fp32``), and a tied embedding's lookup gradient is
added row by row into the same fp32 ``.grad`` (``index_add_``) instead of
being built as a dense ``[vocab, hidden]`` tensor and added.

The ops are ``torch.library`` custom ops, so ``torch.compile`` traces through them without a
graph break (the mutation of the fp32 gradient happens in place, no copy) and a CUDA graph
captures them. Numerics: on CUDA the fused weight gradient is summed in fp32 (not rounded to
bf16 per micro-batch first), as in Megatron, so gradients differ from the unfused path by that
rounding (well within the rerun tolerances); elsewhere (CPU, or a torch without the fp32-output
matmul) the weight gradient is computed in the compute dtype and added, which is bitwise the
unfused path.

Modules opt in through attributes that ``ComputeWeights(fuse_grad_accumulation=True)`` sets for
one micro-batch at a time: :class:`Linear` reads ``weight_main_grad``; the GPT its output
layer's and its lookup's (``stalwart.models.GPT``). ``None`` (the default): the plain ops.

Example (CPU: the fused gradient equals the unfused one bitwise)::

    >>> import torch
    >>> layer = Linear(4, 3)
    >>> x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    >>> w, b = layer.weight.detach().bfloat16(), layer.bias.detach().bfloat16()
    >>> main_grad = torch.zeros(3, 4)
    >>> linear_accumulating(x, w, b, main_grad).float().sum().backward()
    >>> unfused = (torch.ones(2, 3, dtype=torch.bfloat16).t() @ x.detach()).float()
    >>> torch.equal(main_grad, unfused)
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "embedding_accumulating", "fp32_wgrad_supported", "linear_accumulating"]


def fp32_wgrad_supported(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32, out=fp32)`` runs for ``dtype``
    inputs on ``device`` (CUDA, torch >= 2.9): one small matmul, checked once by the caller."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, device=device, dtype=dtype)
    out = torch.zeros(2, 2, device=device)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(out[0, 0].item() == 2.0)  # one deliberate sync, at construction


@torch.library.custom_op("stalwart::accumulate_wgrad", mutates_args=("main_grad",))
def accumulate_wgrad(
    grad_out: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor, fp32_gemm: bool
) -> None:
    """``main_grad += grad_out^T @ x`` over every leading dimension (the weight gradient of
    ``y = x @ W^T``), in one fp32-output GEMM when ``fp32_gemm``, else computed in the inputs'
    dtype and added (the unfused numerics)."""
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    inputs = x.reshape(-1, x.shape[-1])
    if fp32_gemm:
        torch.addmm(main_grad, dy.t(), inputs, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(dy.t() @ inputs)


@torch.library.custom_op("stalwart::accumulate_rows", mutates_args=("main_grad",))
def accumulate_rows(ids: torch.Tensor, grad_out: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad[ids[i]] += grad_out[i]`` for every lookup (an embedding's gradient)."""
    rows = grad_out.reshape(-1, grad_out.shape[-1]).to(main_grad.dtype)
    # index_add_ (atomic adds on CUDA, like Inductor's own embedding backward), not
    # index_put_(accumulate=True): its sort-based kernel cost 1.3 ms per micro-batch at
    # gpt2-124m on the H200, more than the dense gradient it replaces.
    main_grad.index_add_(0, ids.reshape(-1), rows)


@torch.library.custom_op("stalwart::linear_accumulating", mutates_args=())
def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    main_grad: torch.Tensor,
    fp32_gemm: bool,
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Any, main_grad: Any, fp32_gemm: bool) -> Any:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias, main_grad, fp32_gemm = inputs
    ctx.save_for_backward(x, weight)
    # Not saved (version-checked): other ops add into it before this backward runs.
    ctx.main_grad = main_grad
    ctx.has_bias = bias is not None
    ctx.fp32_gemm = fp32_gemm


def _linear_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    accumulate_wgrad(grad_out, x, ctx.main_grad, ctx.fp32_gemm)
    grad_x = grad_out @ weight
    grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
    # The weight's own gradient is None: it went into main_grad.
    return grad_x, None, grad_bias, None, None


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("stalwart::embedding_accumulating", mutates_args=())
def _embedding(ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


@_embedding.register_fake
def _(ids: torch.Tensor, weight: torch.Tensor, main_grad: Any) -> Any:
    return weight.new_empty(*ids.shape, weight.shape[1])


def _embedding_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ids, _, main_grad = inputs
    ctx.save_for_backward(ids)
    ctx.main_grad = main_grad  # (not version-checked, as above)


def _embedding_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    (ids,) = ctx.saved_tensors
    accumulate_rows(ids, grad_out, ctx.main_grad)
    return None, None, None


_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


def linear_accumulating(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    main_grad: torch.Tensor,
    fp32_gemm: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in ``weight``'s dtype (``x`` and ``bias`` are cast, as
    autocast would) whose weight gradient is added into the fp32 ``main_grad`` in the backward;
    ``weight`` itself gets no gradient. ``fp32_gemm``: one fp32-output GEMM (CUDA, see
    :func:`fp32_wgrad_supported`)."""
    if bias is not None:
        bias = bias.to(weight.dtype)
    return _linear(x.to(weight.dtype), weight, bias, main_grad, fp32_gemm)


def embedding_accumulating(
    ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor
) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose gradient is added row by row into ``main_grad``
    (``weight`` itself gets no gradient)."""
    return _embedding(ids, weight, main_grad)


class Linear(nn.Linear):
    """``nn.Linear`` that, while ``weight_main_grad`` is set (by ``ComputeWeights`` with
    gradient accumulation fusion), adds its weight gradient into that fp32 tensor instead of
    producing one (:func:`linear_accumulating`). Unset, it is ``nn.Linear``."""

    weight_main_grad: torch.Tensor | None = None
    fp32_wgrad: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = self.weight_main_grad
        if target is None:
            return super().forward(x)
        return linear_accumulating(x, self.weight, self.bias, target, self.fp32_wgrad)
