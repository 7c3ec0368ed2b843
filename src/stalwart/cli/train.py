"""Run training from a validated config: set up the process group, train, map errors to exit codes."""

from __future__ import annotations

import logging
import shlex
import sys

from stalwart.checkpoint import CheckpointError
from stalwart.config.run import RunConfig
from stalwart.distributed.process_group import destroy_distributed, init_distributed
from stalwart.train.trainer import TrainOutcome, run_training

logger = logging.getLogger("stalwart.cli")


def _demo_epilogue(config: RunConfig, outcome: TrainOutcome) -> None:
    save = config.checkpoint.save
    print(f"\nDemo finished at iteration {outcome.iteration} ({outcome.reason.value}).")
    if save:
        print(f"Checkpoint: {save}/iter_{outcome.iteration:07d} (latest in {save}/latest_checkpointed_iteration.txt)")
        resume = " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "--demo")
        print(f"Resume (e.g. train further): stalwart {resume} --demo --train-iters {outcome.iteration + 100}")
    if config.obs.metrics_file:
        print(f"Metrics: {config.obs.metrics_file}")


def run_from_cli(config: RunConfig, demo: bool = False) -> int:
    """Train under the current launcher (plain process or torchrun); returns the exit code."""
    try:
        ctx = init_distributed(
            use_cpu=config.training.use_cpu,
            timeout_s=config.training.distributed_timeout_minutes * 60,
        )
    except (RuntimeError, ValueError) as exc:
        sys.stderr.write(f"stalwart train: error: cannot initialise distributed training: {exc}\n")
        return 1
    try:
        outcome = run_training(config, ctx)
    except ValueError as exc:
        sys.stderr.write(f"stalwart train: error: {exc}\n")
        return 2
    except CheckpointError as exc:
        sys.stderr.write(f"stalwart train: checkpoint error: {exc}\n")
        return 2
    finally:
        destroy_distributed()
    if demo and ctx.is_main:
        _demo_epilogue(config, outcome)
    return outcome.exit_code
