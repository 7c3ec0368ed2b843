"""The reference GPT's forward step: fetch a micro-batch, move it to the device, run the model.

Validation hooks (the rerun state machine's loss checks) receive the detached ``lm loss`` right
after the forward pass; they must only record device-side checks (no host sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

LossCheck = Callable[[torch.Tensor], None]


class GPTForwardStep:
    """Callable ``(data_iterator, model) -> dict`` for :func:`stalwart.train.step.forward_backward`.

    Args:
        device: where the model runs; batches are copied there with ``non_blocking=True``.
        autocast: factory returning the autocast context for the forward pass.
        loss_check: optional hook given the per-micro-batch loss (e.g. the rerun state
            machine's NaN/Inf/spike checks); it records device-side checks and returns nothing.
    """

    def __init__(
        self,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        loss_check: LossCheck | None = None,
        batch_timer: Any = None,
    ) -> None:
        self.device = device
        self.autocast = autocast
        self.loss_check = loss_check
        # The ``batch-generator`` timer (level 2); a NullTimer or None when not timed.
        self.batch_timer = batch_timer

    def __call__(
        self, data_iterator: Iterator[dict[str, torch.Tensor]], model: nn.Module
    ) -> dict[str, torch.Tensor]:
        if self.batch_timer is not None:
            self.batch_timer.start()
        batch = next(data_iterator)
        input_ids = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        if self.batch_timer is not None:
            self.batch_timer.stop()
        with self.autocast():
            output: dict[str, torch.Tensor] = model(input_ids, labels)
        if self.loss_check is not None:
            self.loss_check(output["loss"].detach())
        return output
