"""DDP's gradient reduction for a forward that runs on bf16 compute copies.

With :class:`stalwart.loop.ComputeWeights` the forward uses bf16 copies of the matmul weights,
so DDP's autograd hooks on the fp32 parameters never fire for them and its reducer would wait
for gradients that never come. :class:`ReducedGradChecks` takes the reducer's place: the guarded
step runs the micro-batches on the unwrapped module (no DDP hook, no reducer), and after a
pass's last micro-batch, when the copies' gradients are already added into the fp32 ``.grad``:

1. the gradient checks of the rerun machine run on this rank's local gradients, per bucket of
   the same fixed layout as DDP's comm hook (`stalwart.reliability.rerun.bucket_layout` at DDP's
   ``bucket_bytes_cap``), before any reduction, so a peer can replay them as with plain DDP;
2. the fp32 gradients are averaged over the data-parallel group as DDP's default hook does
   (each bucket flattened, divided by the world size, summed in one all-reduce per bucket):
   the same values, bit for bit, as DDP given the same local gradients.

Device work only (no host sync), so a full-iteration CUDA graph can capture it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stalwart.reliability.rerun import GradCheckState, RerunStateMachine, bucket_layout
from stalwart.reliability.rerun.checks.grads import DEFAULT_BUCKET_BYTES


class ReducedGradChecks(GradCheckState):
    """The gradient checks and DDP's all-reduce, after the backward (see module docstring).

    Args:
        machine: the rerun state machine (its ``checks.grads`` says whether the checks run).
        ddp_model: the DDP-wrapped model: its parameters, bucket size and process group.
        process_group: the data-parallel group (default: DDP's).
    """

    def __init__(
        self,
        machine: RerunStateMachine,
        ddp_model: DistributedDataParallel,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        size = int(getattr(ddp_model, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES))
        group = process_group if process_group is not None else ddp_model.process_group
        super().__init__(
            machine.recorder, list(ddp_model.module.parameters()), group, bucket_bytes=size
        )
        self.run_checks = machine.recorder.checks.grads
        layout = bucket_layout(self.params, size)
        # DDP's initial bucket order: the last parameters first (their gradients come first).
        self.buckets: list[list[torch.nn.Parameter]] = [
            [p for p, b in zip(self.params, layout, strict=True) if b == bucket]
            for bucket in range(self.num_buckets)
        ]

    def check_after_backward(self) -> None:
        """After a pass's last backward: check the local gradients, then average them."""
        if self.run_checks:
            super().check_after_backward()
        self.all_reduce()

    def all_reduce(self) -> None:
        """Average every trained parameter's ``.grad`` over the group, one collective per
        bucket. A parameter without a gradient on this rank takes part with zeros (every rank
        must reduce the same buffers)."""
        world = dist.get_world_size(self.process_group)
        for bucket in self.buckets:
            for param in bucket:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            grads: Sequence[torch.Tensor] = [p.grad for p in bucket]  # type: ignore[misc]
            flat = torch._utils._flatten_dense_tensors(grads)
            flat.div_(world)  # before the sum, as DDP's default hook (the same rounding)
            dist.all_reduce(flat, group=self.process_group)
            reduced = torch._utils._unflatten_dense_tensors(flat, grads)
            torch._foreach_copy_(list(grads), list(reduced))


__all__ = ["ReducedGradChecks"]
