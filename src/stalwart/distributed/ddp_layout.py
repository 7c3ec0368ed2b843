"""DDP's gradient bucket layout, settled before the first training iteration of a process.

DDP reduces gradients in buckets. Its first backward in a process uses an initial layout (the
parameters in reverse registration order, one bucket); at its next forward it rebuilds the
buckets once, in the order the first backward made the gradients ready. Where an element lands
in a bucket decides the order in which the ranks' values are summed, and with 3 or more ranks
that order changes the rounding (gloo's and NCCL's ring all-reduce sum each chunk starting at a
different rank). So an uninterrupted job reduces iteration k with the rebuilt layout while a job
resumed at k reduces the same iteration with the initial one: resuming a job of 3 or more DDP
ranks was not bitwise equal to not stopping it. With 2 ranks the sum of two values is the same
in either order, and the layout cannot change a result.

:func:`settle_bucket_layout` runs one throw-away forward and backward through the wrapper right
after it is built (eager, before ``torch.compile`` or a graph capture sees the model), so the
rebuild happens at the first real forward and every training iteration of every process
reduces with the same layout. Nothing of that pass survives: the gradients are dropped, the
model's buffers copied back and the random generators restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Below this many ranks the layout cannot change a reduced value (a + b == b + a).
MIN_RANKS_ORDER_MATTERS = 3


def needs_settled_layout(model: nn.Module) -> TypeGuard[DistributedDataParallel]:
    """Whether ``model`` is a DDP wrapper over enough ranks for its bucket layout to matter."""
    if not isinstance(model, DistributedDataParallel):
        return False
    return model.process_group.size() >= MIN_RANKS_ORDER_MATTERS


def settle_bucket_layout(
    model: DistributedDataParallel, loss_of: Callable[[nn.Module], torch.Tensor]
) -> None:
    """One forward (``loss_of(model)``: a scalar loss through the wrapper, every trained
    parameter reached) and backward, all ranks together (it all-reduces once), before the first
    training iteration; see the module docstring.

    Contract: the module's parameters, buffers and every random generator (CPU and the
    parameters' CUDA device) are as before; every parameter's ``.grad`` is None afterwards, so
    call it before anything holds a gradient. Run it eagerly: a compiled or captured first pass
    would pay its compile here, outside the ledger's ``compile`` bucket.
    """
    module = model.module
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        loss_of(model).backward()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    for param in module.parameters():
        param.grad = None


__all__ = ["MIN_RANKS_ORDER_MATTERS", "needs_settled_layout", "settle_bucket_layout"]
