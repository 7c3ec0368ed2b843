"""The tiny GPT's forward step for ``GuardedStep`` tests, with one forward's loss made NaN."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PoisonedForward:
    """``forward_step(batch, model)``: the GPT's loss on ``batch["ids"]`` / ``batch["labels"]``;
    the ``nan_call``-th call (0-based, counting every forward, reruns included) returns NaN.
    ``calls`` counts the forwards run so far."""

    def __init__(self, nan_call: int = -1) -> None:
        self.calls, self.nan_call = 0, nan_call

    def __call__(self, batch: dict[str, torch.Tensor], model: nn.Module) -> Any:
        out = model(batch["ids"], batch["labels"])
        if self.calls == self.nan_call:
            out["loss"] = out["loss"] * float("nan")
        self.calls += 1
        return out
