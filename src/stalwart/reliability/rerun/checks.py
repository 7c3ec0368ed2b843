"""Ready-made validation points for a training loop: loss and gradients.

None of these syncs: each records device scalars on the machine, which reads them once per
iteration. Messages, tolerances and fatality follow Megatron (loss: tolerance 0, the forward is
deterministic; grads: tolerance 1e-3 for non-deterministic backward kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist

from stalwart.reliability.rerun.config import RerunConfig
from stalwart.reliability.rerun.machine import RerunStateMachine

NAN_LOSS_MESSAGE = "found NaN in local forward loss calculation"
INF_LOSS_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_LOSS_MESSAGE = "Spiky loss"
_GRAD_WHERE = "in backward pass before data-parallel communication collective"
NAN_GRAD_MESSAGE = f"found NaN in local grad norm {_GRAD_WHERE}"
INF_GRAD_MESSAGE = f"found Inf in local grad norm {_GRAD_WHERE}"
LARGE_GRAD_MESSAGE = f"found unexpected large grads {_GRAD_WHERE}"
GRAD_TOLERANCE = 1e-3


def check_loss(sm: RerunStateMachine, loss: torch.Tensor, config: RerunConfig) -> None:
    """NaN/Inf (fatal, tolerance 0) and spiky-loss (non-fatal) checks of a local loss."""
    if config.check_for_nan_in_loss_and_grad:
        sm.validate_result(loss, torch.isnan, NAN_LOSS_MESSAGE, tolerance=0.0, fatal=True)
        sm.validate_result(loss, torch.isinf, INF_LOSS_MESSAGE, tolerance=0.0, fatal=True)
    if config.check_for_spiky_loss:
        spiky = functools.partial(
            sm.is_unexpectedly_large, threshold=config.spiky_loss_factor, context="loss"
        )
        sm.validate_result(loss, spiky, SPIKY_LOSS_MESSAGE, tolerance=0.0, fatal=False)


def check_grad_norm(sm: RerunStateMachine, grad_norm: torch.Tensor, config: RerunConfig) -> None:
    """NaN/Inf (fatal) and large-grads (non-fatal) checks of a *local* (pre-reduction) grad norm."""
    if config.check_for_nan_in_loss_and_grad:
        sm.validate_result(grad_norm, torch.isnan, NAN_GRAD_MESSAGE, tolerance=GRAD_TOLERANCE)
        sm.validate_result(grad_norm, torch.isinf, INF_GRAD_MESSAGE, tolerance=GRAD_TOLERANCE)
    if config.check_for_large_grads:
        large = functools.partial(
            sm.is_unexpectedly_large, threshold=config.large_grads_factor, context="grads"
        )
        sm.validate_result(
            grad_norm, large, LARGE_GRAD_MESSAGE, tolerance=GRAD_TOLERANCE, fatal=False
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all local gradients, in float64 so squares cannot overflow (device ops only)."""
    # FSDP2 gradients are DTensors: this rank's shard is what it computed and must check.
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float64) for n in norms]))


def check_grads(
    sm: RerunStateMachine, parameters: Iterable[torch.nn.Parameter], config: RerunConfig
) -> None:
    """Without DDP: check the local gradients after backward, before any reduction or step."""
    if config.check_for_nan_in_loss_and_grad or config.check_for_large_grads:
        check_grad_norm(sm, local_grad_norm(parameters), config)


class GradCheckState:
    """State of the DDP comm hook: accumulates bucket norms, validates on the last bucket.

    One check per backward (not per bucket) keeps call identities stable when DDP rebuilds its
    buckets after the first iteration, which an in-place rerun of iteration 0 would otherwise see.
    """

    def __init__(
        self, sm: RerunStateMachine, config: RerunConfig, process_group: dist.ProcessGroup | None
    ) -> None:
        self.sm = sm
        self.config = config
        self.process_group = process_group
        self.sum_sq: torch.Tensor | None = None

    def add_bucket(self, buffer: torch.Tensor, is_last: bool) -> None:
        sq = torch.linalg.vector_norm(buffer.detach(), dtype=torch.float64) ** 2
        self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        if is_last:
            norm, self.sum_sq = self.sum_sq.sqrt(), None
            check_grad_norm(self.sm, norm, self.config)


def _grad_check_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Left unannotated on purpose: DDP inspects the signature and rejects string annotations.
    buffer = bucket.buffer()
    state.add_bucket(buffer, bucket.is_last())
    group = state.process_group
    buffer.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def grad_check_comm_hook(
    sm: RerunStateMachine,
    config: RerunConfig,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[GradCheckState, object]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    The hook checks the local gradients of each backward for NaN/Inf (and large grads) on device
    before the all-reduce, then averages them like DDP's default hook.
    """
    return GradCheckState(sm, config, process_group), _grad_check_allreduce_hook


def register_grad_check_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    sm: RerunStateMachine,
    config: RerunConfig,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Register :func:`grad_check_comm_hook` on a DDP model (before the first backward)."""
    state, hook = grad_check_comm_hook(sm, config, process_group)
    ddp_model.register_comm_hook(state, hook)  # type: ignore[arg-type]
