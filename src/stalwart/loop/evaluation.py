"""Forward-only evaluation with the guarded step's plan (``GuardedStep.evaluate``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from stalwart.loop.microbatches import average_reported
from stalwart.loop.plans import Runners
from stalwart.reliability.rerun import RerunStateMachine


class Evaluated(Protocol):
    """What an evaluation reads off the guarded step (``GuardedStep`` is one): typed here so
    that this module does not import the step that calls it."""

    model: nn.Module
    machine: RerunStateMachine
    runners: Runners
    dp_group: dist.ProcessGroup | None
    num_microbatches: int


def evaluate(
    step: Evaluated,
    data_iterator: Any,
    eval_iters: int,
    num_microbatches: int | None,
    each_iteration: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, float]:
    """See ``GuardedStep.evaluate``. The model is put back in train mode on every exit path.

    Under a full-iteration graph the evaluation stage replays without Python, so the losses are
    checked from their means (a NaN/Inf in any micro-batch propagates into the mean) at no
    extra sync; eagerly each micro-batch's loss is checked.
    """
    n = num_microbatches or step.num_microbatches
    machine, model = step.machine, step.model
    totals: dict[str, torch.Tensor] = {}
    model.eval()
    try:
        with machine.disabled():
            for _ in range(eval_iters):
                with each_iteration():
                    reported = step.runners.evaluate(
                        data_iterator=data_iterator, num_microbatches=n, forward_only=True
                    )
                for key, value in average_reported(reported, step.dp_group).items():
                    totals[key] = totals.get(key, torch.zeros_like(value)) + value
    finally:
        model.train()
    # Deliberate sync: evaluation results are printed and written to the sinks.
    losses = {k: float(v.item()) / max(eval_iters, 1) for k, v in totals.items()}
    if step.runners.checks_eval_on_host:
        with machine.disabled():
            for mean in losses.values():
                machine.recorder.check_loss(torch.tensor(mean, dtype=torch.float64))
    return losses
