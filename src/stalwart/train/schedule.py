"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to ``--min-lr``."""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer

from stalwart.config.training import LRDecayStyle, OptimizerConfig


def learning_rate_at(iteration: int, config: OptimizerConfig, train_iters: int) -> float:
    """Learning rate for the 0-based ``iteration`` (pure function).

    Warm-up is linear over ``lr_warmup_iters`` iterations, reaching ``lr`` at the last warm-up
    iteration (iteration 0 already trains with ``lr / warmup``, never with 0). Decay then runs
    from ``lr`` to ``min_lr`` until ``lr_decay_iters`` (default: ``train_iters``) and stays at
    ``min_lr`` afterwards.
    """
    step = iteration + 1
    warmup = config.lr_warmup_iters
    if warmup > 0 and step <= warmup:
        return config.lr * step / warmup
    if config.lr_decay_style is LRDecayStyle.CONSTANT:
        return config.lr
    decay_iters = config.lr_decay_iters or train_iters
    if step >= decay_iters:
        return config.min_lr
    span = max(decay_iters - warmup, 1)
    ratio = min(max((step - warmup) / span, 0.0), 1.0)
    delta = config.lr - config.min_lr
    if config.lr_decay_style is LRDecayStyle.LINEAR:
        return config.lr - delta * ratio
    return config.min_lr + 0.5 * delta * (1.0 + math.cos(math.pi * ratio))


class LRScheduler:
    """Sets the optimizer's learning rate for each iteration from :func:`learning_rate_at`.

    The schedule is a pure function of the iteration, so its checkpoint state is only a record
    of the settings it was saved with (used to warn when a resumed run changed them).
    """

    def __init__(self, optimizer: Optimizer, config: OptimizerConfig, train_iters: int) -> None:
        self.optimizer = optimizer
        self.config = config
        self.train_iters = train_iters
        self.last_lr = learning_rate_at(0, config, train_iters)

    def set_iteration(self, iteration: int) -> float:
        """Apply the learning rate of the 0-based ``iteration`` to every parameter group."""
        lr = learning_rate_at(iteration, self.config, self.train_iters)
        for group in self.optimizer.param_groups:
            current = group["lr"]
            if hasattr(current, "fill_"):
                current.fill_(lr)  # a device tensor (graph-captured optimizer): update in place
            else:
                group["lr"] = lr
        self.last_lr = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.config.lr,
            "min_lr": self.config.min_lr,
            "lr_warmup_iters": self.config.lr_warmup_iters,
            "lr_decay_iters": self.config.lr_decay_iters,
            "lr_decay_style": self.config.lr_decay_style.value,
            "train_iters": self.train_iters,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Settings come from the current config (Megatron's override behaviour); nothing to load."""
        del state
