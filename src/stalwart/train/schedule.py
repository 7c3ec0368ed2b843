"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to ``--min-lr``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch.optim import Optimizer

from stalwart.config.training import LRDecayStyle, OptimizerConfig
from stalwart.train.schedule_resume import (
    ScheduleSettings,
    decide_schedule,
    policy_of,
    settings_from_state,
)


def _rate(step: float, warmup: float, decay_end: float, config: OptimizerConfig) -> float:
    """The schedule in any unit (iterations or samples): ``step`` units done after this one."""
    if warmup > 0 and step <= warmup:
        return config.lr * step / warmup
    if config.lr_decay_style is LRDecayStyle.CONSTANT:
        return config.lr
    if step >= decay_end:
        return config.min_lr
    span = max(decay_end - warmup, 1)
    ratio = min(max((step - warmup) / span, 0.0), 1.0)
    delta = config.lr - config.min_lr
    if config.lr_decay_style is LRDecayStyle.LINEAR:
        return config.lr - delta * ratio
    return config.min_lr + 0.5 * delta * (1.0 + math.cos(math.pi * ratio))


def learning_rate_at(iteration: int, config: OptimizerConfig, train_iters: int) -> float:
    """Learning rate for the 0-based ``iteration`` (pure function).

    Warm-up is linear over ``lr_warmup_iters`` iterations, reaching ``lr`` at the last warm-up
    iteration (iteration 0 already trains with ``lr / warmup``, never with 0). Decay then runs
    from ``lr`` to ``min_lr`` until ``lr_decay_iters`` (default: ``train_iters``) and stays at
    ``min_lr`` afterwards.
    """
    decay_end = config.lr_decay_iters or train_iters
    return _rate(iteration + 1, config.lr_warmup_iters, decay_end, config)


def learning_rate_at_samples(
    samples_after: int, config: OptimizerConfig, train_samples: int
) -> float:
    """Learning rate of the iteration after which ``samples_after`` samples are consumed
    (``--train-samples``): the same shape in samples, over ``lr_warmup_samples`` and until
    ``lr_decay_samples`` (default ``train_samples``). A batch-size ramp thus warms up over the
    same samples as without it."""
    decay_end = config.lr_decay_samples or train_samples
    return _rate(samples_after, config.lr_warmup_samples, decay_end, config)


class LRScheduler:
    """Sets the optimizer's learning rate for each iteration from :func:`learning_rate_at`.

    The schedule is a pure function of the iteration, so its checkpoint state is only a record
    of the settings it was saved with: `resume_from` compares them with this run's and applies
    Megatron's rule (`stalwart.train.schedule_resume`).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: OptimizerConfig,
        train_iters: int,
        train_samples: int | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.train_iters = train_iters
        self.train_samples = train_samples  # set: the schedule counts samples
        self.last_lr = learning_rate_at(0, config, train_iters)

    def set_iteration(self, iteration: int, samples_after: int | None = None) -> float:
        """Apply the learning rate of the 0-based ``iteration`` to every parameter group.

        With ``train_samples`` the rate is a function of ``samples_after`` (the consumed samples
        once this iteration is done), which the caller must then pass.
        """
        if self.train_samples is not None:
            if samples_after is None:
                raise ValueError("a sample-based schedule (--train-samples) needs samples_after")
            lr = learning_rate_at_samples(samples_after, self.config, self.train_samples)
        else:
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
            "train_samples": self.train_samples,
            "lr_warmup_samples": self.config.lr_warmup_samples,
            "lr_decay_samples": self.config.lr_decay_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the schedule is a function of the iteration. A resumed run calls
        `resume_from` with this state to compare the schedules."""
        del state

    def settings(self) -> ScheduleSettings:
        """The values that shape this scheduler's curve (defaults resolved)."""
        c = self.config
        if self.train_samples is not None:
            unit, warmup, end = "samples", c.lr_warmup_samples, c.lr_decay_samples
            end = end or self.train_samples
        else:
            unit, warmup, end = "iterations", c.lr_warmup_iters, c.lr_decay_iters
            end = end or self.train_iters
        style = c.lr_decay_style.value
        return ScheduleSettings(unit, c.lr, c.min_lr, warmup, end, style)

    def _with(self, s: ScheduleSettings) -> tuple[OptimizerConfig, int | None]:
        """(config, train_samples) that give the curve ``s`` (decay end made explicit)."""
        unit_fields: dict[str, Any] = (
            {"lr_warmup_samples": s.warmup, "lr_decay_samples": s.decay_end}
            if s.unit == "samples"
            else {"lr_warmup_iters": s.warmup, "lr_decay_iters": s.decay_end}
        )
        config = dataclasses.replace(
            self.config,
            lr=s.lr,
            min_lr=s.min_lr,
            lr_decay_style=LRDecayStyle(s.style),
            **unit_fields,
        )
        return config, (s.decay_end if s.unit == "samples" else None)

    def _rate_of(self, s: ScheduleSettings, iteration: int, samples_after: int | None) -> float:
        config, train_samples = self._with(s)
        if train_samples is not None:
            return learning_rate_at_samples(samples_after or 0, config, train_samples)
        return learning_rate_at(iteration, config, self.train_iters)

    def resume_from(
        self,
        state: Any,
        iteration: int,
        samples_after: int | None = None,
        load_optim: bool = True,
    ) -> str | None:
        """Resume at the 0-based ``iteration`` from a checkpoint whose scheduler state is
        ``state``: apply Megatron's rule (``--override-opt-param-scheduler`` /
        ``--use-checkpoint-opt-param-scheduler``; refused by default) and return the one
        warning line to print, if any. ``ValueError`` when the schedules differ and no flag
        says which wins. ``samples_after``: consumed samples after that iteration (sample-based
        schedules)."""
        saved, current = settings_from_state(state), self.settings()
        policy = policy_of(
            self.config.override_opt_param_scheduler,
            self.config.use_checkpoint_opt_param_scheduler,
            load_optim,
        )
        lr_next = (0.0, 0.0)
        if saved is not None and saved != current:
            lr_next = (
                self._rate_of(saved, iteration, samples_after),
                self._rate_of(current, iteration, samples_after),
            )
        decision = decide_schedule(saved, current, policy, lr_next)
        if decision.settings != current:
            self.config, self.train_samples = self._with(decision.settings)
        return decision.warning
