"""The CUDA kernel of the fused cross entropy (``stalwart.models.fused_cross_entropy``).

Imported only on CUDA (Triton ships with CUDA builds of torch, not the CPU wheel). One program
per row of the logits: an online max and sum of exponentials over the row in blocks gives the
log-sum-exp and the row's loss; a second sweep over the same row writes the loss gradient
``(softmax - one_hot(label)) * scale`` over the logits, in place. The row (``V`` values) is still
in L2 when the second sweep reads it (a row is 100 KB at V = 50304 in bf16, and the programs in
flight hold a few tens of MB), so the logits cross HBM once in and once out, where the unfused
loss reads them once in the forward and again in the backward, and writes a new gradient
tensor besides. Written here because no library kernel does this under ``torch.compile`` with
CUDA graphs (Liger's breaks the graph on a host read; Transformer Engine is not a dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on the H200 at gpt2-124m's shape ([32768, 50304] bf16, bench/cross_entropy_fusion.py).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _loss_and_grad_in_place(
    logits_ptr,
    row_stride,
    labels_ptr,
    losses_ptr,
    scale_ptr,
    vocab,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    # Pass 1: the row's running max and sum of exp (fp32), block by block.
    running_max = float("-inf")
    running_sum = 0.0
    for start in tl.range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max), axis=0
        )
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < vocab)
    target = tl.load(base + label, mask=in_range & (~ignored), other=0.0).to(tl.float32)
    # A label outside [0, vocab) that is not ignore_index gives a NaN loss (the checks see it)
    # where the unfused loss would stop the process with a device assert.
    loss = tl.where(ignored, 0.0, tl.where(in_range, lse - target, float("nan")))
    tl.store(losses_ptr + row, loss)
    scale = tl.where(ignored, 0.0, tl.load(scale_ptr))
    # Pass 2: overwrite the row with its gradient (the row is read again from L2).
    for start in tl.range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse)
        grad = tl.where(cols == label, grad - 1.0, grad) * scale
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def loss_and_grad_in_place(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Per-row losses (fp32 ``[rows]``); ``logits`` (``[rows, vocab]``, last dim contiguous)
    is overwritten with ``(softmax - one_hot) * scale`` (zero rows where ignored). ``scale``:
    a one-element fp32 device tensor (no host read)."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        _loss_and_grad_in_place[(rows,)](
            logits,
            logits.stride(0),
            labels,
            losses,
            scale,
            vocab,
            ignore_index,
            BLOCK=block,
            num_warps=num_warps,
        )
    return losses
