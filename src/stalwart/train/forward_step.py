"""The reference GPT's forward step for :class:`stalwart.loop.GuardedStep`.

The step moves the batch to the device, runs it under autocast, checks the loss on the device
and scales the backward; this function only maps a micro-batch to the model's outputs.
"""

from __future__ import annotations

import torch
from torch import nn


def gpt_forward_step(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"loss", "lm loss", ...}`` of the GPT on ``{"input_ids", "labels"}``."""
    output: dict[str, torch.Tensor] = model(batch["input_ids"], batch["labels"])
    return output
