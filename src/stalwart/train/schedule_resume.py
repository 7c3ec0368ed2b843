"""Resuming with another learning-rate schedule: Megatron's rule, decided by pure functions.

The schedule is a pure function of the iteration (or of the consumed samples), so a resumed run
with other settings silently follows another curve: ``--train-iters 200`` on a checkpoint saved
with ``--train-iters 100`` re-plans the cosine decay from the warm-up end to iteration 200, and
the learning rate jumps back up. As Megatron's ``OptimizerParamScheduler.load_state_dict``:

* by default the checkpoint's schedule must match this run's: a difference is refused (one line
  naming every differing flag, both values and the learning rate it changes; exit code 2);
* ``--override-opt-param-scheduler``: this run's schedule wins (one warning line says what
  changes);
* ``--use-checkpoint-opt-param-scheduler``: the checkpoint's schedule wins (one warning line).

Compared are the values that shape the curve: peak and minimum LR, warm-up, decay end and style,
and the unit (iterations or samples); ``--train-iters`` only through the decay end it defaults,
so ``--train-iters 200 --lr-decay-iters 100`` on a checkpoint of ``--train-iters 100`` is the same
schedule. With ``--no-load-optim`` the checkpoint's schedule is not loaded (Megatron's behaviour):
this run's is used, with the same warning when it differs.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.config.training import LRDecayStyle


class SchedulePolicy(enum.Enum):
    """Which schedule wins when the checkpoint's differs from this run's."""

    REFUSE = "refuse"  # Megatron's default: the values must match
    OVERRIDE = "override"  # --override-opt-param-scheduler
    USE_CHECKPOINT = "use_checkpoint"  # --use-checkpoint-opt-param-scheduler
    NOT_LOADED = "not_loaded"  # --no-load-optim: this run's, the checkpoint's is not read


@dataclass(frozen=True)
class ScheduleSettings:
    """What shapes the curve (``decay_end`` already resolved from its default)."""

    unit: str  # "iterations" | "samples"
    lr: float
    min_lr: float
    warmup: int
    decay_end: int
    style: str


@dataclass(frozen=True)
class ScheduleResume:
    """The decision: the settings to train with, and the one line to print (None: silent)."""

    settings: ScheduleSettings
    warning: str | None = None


def settings_from_state(state: Any) -> ScheduleSettings | None:
    """The settings an `LRScheduler` state dict records; None when it is not one (an older or
    damaged checkpoint: nothing to compare)."""
    if not isinstance(state, Mapping):
        return None
    try:
        samples = state.get("train_samples") is not None
        if samples:
            warmup, end = state["lr_warmup_samples"], state["lr_decay_samples"]
            end = end or state["train_samples"]
        else:
            warmup, end = state["lr_warmup_iters"], state["lr_decay_iters"] or state["train_iters"]
        settings = ScheduleSettings(
            unit="samples" if samples else "iterations",
            lr=float(state["lr"]),
            min_lr=float(state["min_lr"]),
            warmup=int(warmup),
            decay_end=int(end),
            style=str(state["lr_decay_style"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
    sane = (
        math.isfinite(settings.lr)
        and math.isfinite(settings.min_lr)
        and settings.warmup >= 0
        and settings.decay_end > 0
        and settings.style in {s.value for s in LRDecayStyle}
    )
    return settings if sane else None  # a damaged record is not compared against


def _flags(unit: str) -> tuple[str, str]:
    if unit == "samples":
        return "--lr-warmup-samples", "decay end (--lr-decay-samples, else --train-samples)"
    return "--lr-warmup-iters", "decay end (--lr-decay-iters, else --train-iters)"


def differences(saved: ScheduleSettings, current: ScheduleSettings) -> list[str]:
    """``"flag X -> Y"`` (checkpoint's -> this run's) for every value that changes the curve."""
    if saved.unit != current.unit:
        return [f"schedule unit (--train-iters or --train-samples): {saved.unit} -> {current.unit}"]
    warmup_flag, end_flag = _flags(current.unit)
    constant = saved.style == current.style == "constant"  # min LR and decay end do not matter
    pairs = [
        ("--lr", saved.lr, current.lr),
        ("--min-lr", saved.min_lr, current.min_lr) if not constant else None,
        (warmup_flag, saved.warmup, current.warmup),
        (end_flag, saved.decay_end, current.decay_end) if not constant else None,
        ("--lr-decay-style", saved.style, current.style),
    ]
    return [f"{name} {old} -> {new}" for name, old, new in filter(None, pairs) if old != new]


def decide_schedule(
    saved: ScheduleSettings | None,
    current: ScheduleSettings,
    policy: SchedulePolicy,
    lr_next: tuple[float, float] = (0.0, 0.0),
) -> ScheduleResume:
    """Megatron's rule (module docstring). ``lr_next``: the learning rate of the next iteration
    under the checkpoint's schedule and under this run's. ``ValueError`` (one line, naming the
    flags) for a difference under ``REFUSE``."""
    changes = differences(saved, current) if saved is not None else []
    if saved is None or not changes:
        return ScheduleResume(current)
    what = "; ".join(changes)
    before, after = lr_next
    lr = f"learning rate of the next iteration {before:.3e} -> {after:.3e}"
    if policy is SchedulePolicy.REFUSE:
        raise ValueError(
            f"the checkpoint's LR schedule differs from this run's (checkpoint -> this run): "
            f"{what}; {lr}. Pass --override-opt-param-scheduler to use this run's schedule, or "
            "--use-checkpoint-opt-param-scheduler to keep the checkpoint's"
        )
    if policy is SchedulePolicy.USE_CHECKPOINT:
        return ScheduleResume(
            saved,
            "LR schedule kept from the checkpoint (--use-checkpoint-opt-param-scheduler), not "
            f"this run's flags (checkpoint -> flags): {what}; the learning rate of the next "
            f"iteration stays {before:.3e}",
        )
    reason = {
        SchedulePolicy.OVERRIDE: "--override-opt-param-scheduler",
        SchedulePolicy.NOT_LOADED: "--no-load-optim: the checkpoint's is not loaded",
    }[policy]
    return ScheduleResume(
        current, f"LR schedule changed on resume ({reason}; checkpoint -> this run): {what}; {lr}"
    )


def policy_of(override: bool, use_checkpoint: bool, load_optim: bool) -> SchedulePolicy:
    """The policy the flags ask for (both flags together are refused by `OptimizerConfig`)."""
    if not load_optim:
        return SchedulePolicy.NOT_LOADED
    if override:
        return SchedulePolicy.OVERRIDE
    if use_checkpoint:
        return SchedulePolicy.USE_CHECKPOINT
    return SchedulePolicy.REFUSE
