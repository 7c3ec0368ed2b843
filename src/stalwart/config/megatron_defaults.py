"""The defaults stalwart does not share with Megatron-LM, and which of them a run relies on.

The rule for defaults (issue 30): stalwart keeps its own defaults (a modern GPT recipe: AdamW
weight decay 0.1, beta2 0.95, cosine decay, no dropout) and never changes them silently. Every
default that differs from Megatron's and that the run relies on (the flag was not given, on the
command line or in ``--config``) is counted on the run's first lines, listed with Megatron's
value in ``run.json`` (``megatron_defaults``), and the whole table is in ``stalwart train
--help``; so a migrating script that omits ``--weight-decay`` learns that it trains with 0.1,
not 0.01. Setting the flag (to either value) removes it from the list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from stalwart.config.training import DataConfig, OptimizerConfig, TrainingConfig
from stalwart.loop.shell_settings import ShellSettings
from stalwart.models import GPTConfig


class RunSettings(Protocol):
    """The parts of the run's config (``stalwart.config.run.RunConfig`` is the one) that the
    defaults are read from: typed here because run.py imports this module."""

    @property
    def model(self) -> GPTConfig: ...

    @property
    def shell(self) -> ShellSettings: ...

    @property
    def data(self) -> DataConfig: ...

    @property
    def optim(self) -> OptimizerConfig: ...

    @property
    def training(self) -> TrainingConfig: ...


@dataclasses.dataclass(frozen=True)
class MegatronDefault:
    """One default stalwart does not share with Megatron: the flag, its destination, Megatron's
    value, how to read this run's value, and when it matters (e.g. MoE flags on MoE models)."""

    flag: str
    dest: str
    megatron: object
    value: Callable[[RunSettings], object]
    applies: Callable[[RunSettings], bool] = lambda c: True


MEGATRON_DEFAULTS: tuple[MegatronDefault, ...] = (
    MegatronDefault("--weight-decay", "weight_decay", 0.01, lambda c: c.optim.weight_decay),
    MegatronDefault("--adam-beta2", "adam_beta2", 0.999, lambda c: c.optim.adam_beta2),
    MegatronDefault(
        "--lr-decay-style", "lr_decay_style", "linear", lambda c: c.optim.lr_decay_style.value
    ),
    MegatronDefault("--hidden-dropout", "hidden_dropout", 0.1, lambda c: c.model.dropout),
    MegatronDefault("--log-interval", "log_interval", 100, lambda c: c.shell.log.log_interval),
    MegatronDefault("--eval-interval", "eval_interval", 1000, lambda c: c.training.eval_interval),
    MegatronDefault(
        "--eval-iters",
        "eval_iters",
        100,
        lambda c: c.training.eval_iters,
        lambda c: c.training.eval_interval > 0,
    ),
    MegatronDefault("--num-workers", "num_workers", 2, lambda c: c.data.num_workers),
    MegatronDefault(
        "--initial-loss-scale",
        "initial_loss_scale",
        2.0**32,
        lambda c: c.training.initial_loss_scale,
        lambda c: c.training.fp16,
    ),
    MegatronDefault(
        "--moe-aux-loss-coeff",
        "moe_aux_loss_coeff",
        0.0,
        lambda c: c.model.moe_aux_loss_coeff,
        lambda c: c.model.is_moe,
    ),
    MegatronDefault(
        "--moe-expert-capacity-factor",
        "moe_capacity_factor",
        None,
        lambda c: c.model.moe_capacity_factor,
        lambda c: c.model.is_moe,
    ),
)


def show(value: object) -> str:
    """A default's value as the lists print it."""
    if value is None:
        return "none"
    if isinstance(value, float) and value >= 1e4 and value.is_integer():
        return str(int(value))  # a loss scale: 65536, not 65536.0
    return str(value)


def megatron_default_differences(config: RunSettings, explicit: set[str]) -> list[str]:
    """``"--flag VALUE (Megatron: VALUE)"`` for every default of `MEGATRON_DEFAULTS` that this
    run relies on (not in ``explicit``) and that differs from Megatron's. Pure."""
    out = []
    for d in MEGATRON_DEFAULTS:
        if d.dest in explicit or not d.applies(config):
            continue
        value = d.value(config)
        if value != d.megatron:
            out.append(f"{d.flag} {show(value)} (Megatron: {show(d.megatron)})")
    return out


def help_section() -> tuple[str, str]:
    """The ``--help`` section: its title, and every flag of the table with Megatron's value."""
    items = ", ".join(f"{d.flag} {show(d.megatron)}" for d in MEGATRON_DEFAULTS)
    return (
        "Defaults unlike Megatron-LM's (Megatron's values; a run's run.json lists those it uses)",
        (f"{items} (stalwart's: each flag's line; setting a flag chooses)"),
    )
