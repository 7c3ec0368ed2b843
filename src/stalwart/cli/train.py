"""Run training from a validated config: set up the process group, train, map errors to exit
codes."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path

from stalwart.checkpoint import CheckpointError
from stalwart.checkpoint.errors import PeerLostError
from stalwart.config.run import RunConfig
from stalwart.distributed.launch_env import env_int
from stalwart.distributed.process_group import destroy_distributed, init_distributed
from stalwart.iteration_dirs import TRACKER_FILENAME, iteration_dir_name
from stalwart.observability.run_dir import RunPaths, run_dir_for
from stalwart.reliability.exit import EXIT_CODE_INTERRUPTED as EXIT_INTERRUPTED
from stalwart.reliability.rerun.attribution.verdict_file import SuspectDeviceError
from stalwart.train.trainer import TrainOutcome, run_training

logger = logging.getLogger("stalwart.cli")


def _loss_summary(metrics_file: str) -> str | None:
    """'first -> last interval loss' from the metrics file, or None when it has no train records."""
    from stalwart.report.clean import is_number, read_jsonl

    records = read_jsonl(Path(metrics_file), [])  # a torn or garbage line is skipped
    losses = [r["loss"] for r in records if r.get("split") == "train" and is_number(r.get("loss"))]
    if len(losses) < 2 or losses[0] == 0:
        return None
    ratio = losses[-1] / losses[0]
    fell = f"loss fell from {losses[0]:.3f} (first log) to {losses[-1]:.3f} (last interval)"
    return f"{fell}: {ratio:.0%} of the first"


def _demo_epilogue(config: RunConfig, outcome: TrainOutcome) -> None:
    save = config.checkpoint.save
    run_dir = run_dir_for(save, config.shell.run_dir)
    metrics = config.shell.sinks.metrics_file or (
        str(RunPaths.for_run(run_dir).metrics) if run_dir else None
    )
    print(f"\nDemo finished at iteration {outcome.iteration} ({outcome.reason.value}).")
    summary = _loss_summary(metrics) if metrics else None
    if summary:
        print(summary)
    if save:
        print(
            f"Checkpoint: {save}/{iteration_dir_name(outcome.iteration)} "
            f"(latest in {save}/{TRACKER_FILENAME})"
        )
        print(  # a longer run changes the LR schedule: say which one (Megatron's rule)
            "Resume and train 100 more iterations at the final learning rate: "
            f"{_command()} train --preset tiny --demo --save {shlex.quote(save)} "
            f"--train-iters {outcome.iteration + 100} --use-checkpoint-opt-param-scheduler"
        )
    if metrics:
        print(f"Metrics: {metrics}")
    if run_dir:
        print(f"Report: {_command()} report {shlex.quote(run_dir)}  (writes {run_dir}/report.html)")


def _command() -> str:
    script = sys.argv[0]
    if os.path.basename(script) == "stalwart":
        return os.path.relpath(script)
    return f"{os.path.relpath(sys.executable)} -m stalwart"


def _user_error(exc: ValueError | CheckpointError) -> int:
    """Bad input or an unusable checkpoint: one line on stderr, exit code 2 (no traceback);
    a device that a rerun verdict names as faulty: exit code 16 (resume elsewhere); a rank that
    went away during a checkpoint commit: exit code 1 (a launcher's restart resumes)."""
    if isinstance(exc, (SuspectDeviceError, PeerLostError)):  # not the user's input
        sys.stderr.write(f"stalwart train: {exc}\n")
        return exc.exit_code
    kind = "checkpoint error" if isinstance(exc, CheckpointError) else "error"
    sys.stderr.write(f"stalwart train: {kind}: {exc}\n")
    return 2


def _run_inprocess(config: RunConfig, demo: bool) -> int:
    """``--inprocess-restart``: the wrapper owns the process group of every attempt."""
    from stalwart.train.inprocess import run_training_inprocess

    try:
        code, outcome = run_training_inprocess(config)
    except (ValueError, CheckpointError) as exc:
        return _user_error(exc)
    if demo and outcome is not None and env_int("RANK", 0) == 0:
        _demo_epilogue(config, outcome)
    return code


def _keep_flight_recorder(config: RunConfig) -> None:
    """With hang detection on, NCCL's flight recorder dumps into the FT log directory when the
    watchdog's soft tier asks (set before any process group exists; the user's settings win)."""
    if config.shell.ft.enable_ft:
        from stalwart.reliability.hang.monitor_client import enable_flight_recorder
        from stalwart.reliability.hang.sections import FT_LOG_DIRNAME

        base = config.checkpoint.save or tempfile.gettempdir()
        enable_flight_recorder(os.path.join(base, FT_LOG_DIRNAME))


def run_from_cli(config: RunConfig, demo: bool = False) -> int:
    """Train under the current launcher (plain process or torchrun); returns the exit code."""
    _keep_flight_recorder(config)
    if config.inprocess.inprocess_restart:
        return _run_inprocess(config, demo)
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
    except (ValueError, CheckpointError) as exc:
        return _user_error(exc)
    except KeyboardInterrupt:
        # Ctrl-C before the handler was installed (start-up), or pressed again to stop at once.
        sys.stderr.write("stalwart train: interrupted; no checkpoint saved for this iteration\n")
        return EXIT_INTERRUPTED
    finally:
        destroy_distributed()
    if demo and ctx.is_main:
        _demo_epilogue(config, outcome)
    return outcome.exit_code
