"""What ``stalwart train`` says on its first line: where the run writes, and which of the defaults
it relies on differ from Megatron-LM's.

The rule for defaults (issue 30): stalwart keeps its own defaults (a modern GPT recipe: AdamW
weight decay 0.1, beta2 0.95, cosine decay, no dropout) and never changes them silently. Every
default that differs from Megatron's and that the run relies on (the flag was not given, on the
command line or in ``--config``) is named on the first line with Megatron's value, so a migrating
script that omits ``--weight-decay`` learns that it trains with 0.1, not 0.01. Setting the flag
(to either value) removes it from the line.

A run without ``--save`` or ``--run-dir`` gets a run directory of its own, as Lightning and
torchtitan do: ``runs/<YYYYmmdd-HHMMSS>`` under the working directory (``$STALWART_RUNS_DIR``
instead of ``runs``). Under torchrun every rank must name the same directory, so the name is
``runs/torchrun-<TORCHELASTIC_RUN_ID>`` (restarts of the job continue it); another multi-process
launcher gets none, and the line says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.config.run import RunConfig

RUNS_DIR_ENV = "STALWART_RUNS_DIR"
DEFAULT_RUNS_DIR = "runs"


@dataclasses.dataclass(frozen=True)
class MegatronDefault:
    """One default stalwart does not share with Megatron: the flag, its destination, Megatron's
    value, how to read this run's value, and when it matters (e.g. MoE flags on MoE models)."""

    flag: str
    dest: str
    megatron: object
    value: Callable[[RunConfig], object]
    applies: Callable[[RunConfig], bool] = lambda c: True


MEGATRON_DEFAULTS: tuple[MegatronDefault, ...] = (
    MegatronDefault("--weight-decay", "weight_decay", 0.01, lambda c: c.optim.weight_decay),
    MegatronDefault("--adam-beta2", "adam_beta2", 0.999, lambda c: c.optim.adam_beta2),
    MegatronDefault("--lr-decay-style", "lr_decay_style", "linear", lambda c: c.optim.lr_decay_style.value),
    MegatronDefault("--hidden-dropout", "hidden_dropout", 0.1, lambda c: c.model.dropout),
    MegatronDefault("--log-interval", "log_interval", 100, lambda c: c.shell.log.log_interval),
    MegatronDefault("--eval-interval", "eval_interval", 1000, lambda c: c.training.eval_interval),
    MegatronDefault("--eval-iters", "eval_iters", 100, lambda c: c.training.eval_iters,
                    lambda c: c.training.eval_interval > 0),
    MegatronDefault("--num-workers", "num_workers", 2, lambda c: c.data.num_workers),
    MegatronDefault("--initial-loss-scale", "initial_loss_scale", 2.0**32,
                    lambda c: c.training.initial_loss_scale, lambda c: c.training.fp16),
    MegatronDefault("--moe-aux-loss-coeff", "moe_aux_loss_coeff", 0.0,
                    lambda c: c.model.moe_aux_loss_coeff, lambda c: c.model.is_moe),
    MegatronDefault("--moe-expert-capacity-factor", "moe_capacity_factor", None,
                    lambda c: c.model.moe_capacity_factor, lambda c: c.model.is_moe),
)  # fmt: skip


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value >= 1e4 and value.is_integer():
        return str(int(value))  # a loss scale: 65536, not 65536.0
    return str(value)


def megatron_default_differences(config: RunConfig, explicit: set[str]) -> list[str]:
    """``"--flag VALUE (Megatron: VALUE)"`` for every default of `MEGATRON_DEFAULTS` that this
    run relies on (not in ``explicit``) and that differs from Megatron's. Pure."""
    out = []
    for d in MEGATRON_DEFAULTS:
        if d.dest in explicit or not d.applies(config):
            continue
        value = d.value(config)
        if value != d.megatron:
            out.append(f"{d.flag} {_show(value)} (Megatron: {_show(d.megatron)})")
    return out


def default_run_dir(
    env: Mapping[str, str], now: datetime.datetime | None = None, exists: Any = os.path.exists
) -> str | None:
    """The run directory of a run given neither ``--save`` nor ``--run-dir`` (see the module
    docstring); None under a multi-process launcher other than torchrun."""
    root = env.get(RUNS_DIR_ENV) or DEFAULT_RUNS_DIR
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        return os.path.join(root, f"torchrun-{run_id}") if run_id else None
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, stamp), 1
    while exists(path):  # two runs started in the same second
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    return path


def with_default_run_dir(config: RunConfig, env: Mapping[str, str]) -> RunConfig:
    """``config`` with `default_run_dir` as ``--run-dir`` when it has neither --save nor
    --run-dir (a changed copy; the original is left as it was)."""
    if config.checkpoint.save is not None or config.shell.run_dir is not None:
        return config  # given (an empty one is refused by the path checks, not replaced)
    run_dir = default_run_dir(env)
    if run_dir is None:
        return config
    return config.replace_shared(run_dir=run_dir)


def start_line(config: RunConfig, explicit: set[str]) -> str:
    """The run's first line: its run directory and the defaults unlike Megatron's it uses."""
    run_dir = config.artefact_dir
    where = (
        f"run directory {run_dir} (metrics, goodput; stalwart report {run_dir})"
        if run_dir
        else "no run directory (pass --save or --run-dir to keep metrics and goodput)"
    )
    differences = megatron_default_differences(config, explicit)
    if not differences:
        return f"stalwart train: {where}"
    return (
        f"stalwart train: {where}; defaults unlike Megatron's (set a flag to choose): "
        + ", ".join(differences)
    )
