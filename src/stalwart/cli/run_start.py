"""What ``stalwart train`` says first: at most two short lines, where the run writes and how
many defaults unlike Megatron-LM's it relies on (the list is in ``run.json``; the table in
``--help``; `stalwart.config.megatron_defaults`).

A run without ``--save`` or ``--run-dir`` gets a run directory of its own, as Lightning and
torchtitan do: ``runs/<YYYYmmdd-HHMMSS>`` under the working directory (``$STALWART_RUNS_DIR``
instead of ``runs``). Under torchrun every rank must name the same directory, so the name is
``runs/torchrun-<TORCHELASTIC_RUN_ID>`` (restarts of the job continue it); another multi-process
launcher gets none, and the line says so.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stalwart.config.megatron_defaults import (
    MEGATRON_DEFAULTS,
    MegatronDefault,
    megatron_default_differences,
)

if TYPE_CHECKING:
    from stalwart.config.run import RunConfig

RUNS_DIR_ENV = "STALWART_RUNS_DIR"
DEFAULT_RUNS_DIR = "runs"
SHORT_LINE = 100  # the second line names as many of the defaults as fit in this many characters


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


def start_lines(config: RunConfig) -> str:
    """The run's first lines (one or two): its run directory, and the defaults unlike
    Megatron's it relies on (``config.megatron_defaults``: counted, the first few named)."""
    run_dir = config.artefact_dir
    first = (
        f"stalwart train: run directory {run_dir} (then: stalwart report {run_dir})"
        if run_dir
        else "stalwart train: no run directory (--save or --run-dir keeps metrics and goodput)"
    )
    relied_on = [item.split(" (Megatron")[0] for item in config.megatron_defaults]
    if not relied_on:
        return first
    where = "run.json and --help list them" if run_dir else "--help lists them"
    head = f"  {len(relied_on)} defaults unlike Megatron's: "
    named: list[str] = []
    for item in relied_on:
        rest = len(relied_on) - len(named) - 1
        tail = f", +{rest} more ({where})" if rest else f" ({where})"
        if named and len(head + ", ".join([*named, item]) + tail) > SHORT_LINE:
            break
        named.append(item)
    left = len(relied_on) - len(named)
    more = f", +{left} more" if left else ""
    return f"{first}\n{head}{', '.join(named)}{more} ({where})"


__all__ = [
    "MEGATRON_DEFAULTS",
    "MegatronDefault",
    "default_run_dir",
    "megatron_default_differences",
    "start_lines",
    "with_default_run_dir",
]
