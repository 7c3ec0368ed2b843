"""Fault kinds of a chaos campaign, the documented outcome of each, and the seeded schedule.

A campaign trains one small job ``--iterations`` long with a checkpoint every ``--save-interval``
iterations. The schedule picks, from ``--seed`` alone, where each fault strikes (iteration, rank),
so a campaign is reproducible: the same seed, iterations and save interval give the same plan.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class ChaosFault(enum.Enum):
    """``stalwart chaos --faults`` values, in the order a default campaign runs them."""

    TRANSIENT_NAN = "transient_nan"
    PERSISTENT_NAN = "persistent_nan"
    SPIKY_LOSS = "spiky_loss"
    SILENT_CORRUPTION = "silent_corruption"
    PEER_PERSISTENT = "peer_persistent"
    GRAD_CORRUPTION = "grad_corruption"
    HANG = "hang"
    SIGKILL = "sigkill"
    SIGTERM_LAUNCHER = "sigterm_launcher"
    EXCEPTION = "exception"
    REPEATABLE_FAULT = "repeatable_fault"
    SIGKILL_ASYNC_SAVE = "sigkill_async_save"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    DISK_FULL = "disk_full"
    CONCURRENT_JOB = "concurrent_job"
    CORRUPT_METADATA = "corrupt_metadata"
    TORN_METRICS = "torn_metrics"


# Exit codes the faulted launch is documented to end with (worker exit code; 0 = graceful).
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad flag or unusable checkpoint / failed save (stalwart.cli)
EXIT_RESUME_ELSEWHERE = 16  # rerun state machine: resume on other hardware to disambiguate
EXIT_VALIDATION_FAILED = 17  # rerun state machine: failed on result validation
EXIT_INPROCESS_GAVE_UP = 75  # in-process restart: the same fault twice


@dataclass(frozen=True)
class Expectation:
    """What a fault kind must produce for the campaign to pass."""

    mechanism: str  # the detection mechanism that must fire
    recovery: str  # the documented recovery path
    exit_code: int  # exit code of the faulted launch (workers)
    recoverable: bool  # False: the run must end (bitwise_equal is null)


EXPECTED: dict[ChaosFault, Expectation] = {
    ChaosFault.TRANSIENT_NAN: Expectation(
        "rerun state machine: in-place rerun not reproducible",
        "exit 17, relaunch from the last periodic checkpoint",
        EXIT_VALIDATION_FAILED,
        True,
    ),
    ChaosFault.PERSISTENT_NAN: Expectation(
        "rerun state machine: reproducible in place, not on another device",
        "exit 16 + checkpoint, relaunch on another device, persistent error diagnosed, exit 17",
        EXIT_VALIDATION_FAILED,
        False,
    ),
    ChaosFault.SPIKY_LOSS: Expectation(
        "rerun state machine: spiky-loss check (non-fatal), in-place rerun",
        "continue (no exit)",
        EXIT_OK,
        True,
    ),
    ChaosFault.SILENT_CORRUPTION: Expectation(
        "replica check: weight fingerprints differ across DP replicas (before the next save)",
        "exit 17 without saving, relaunch from the last (checked) checkpoint",
        EXIT_VALIDATION_FAILED,
        True,
    ),
    ChaosFault.PEER_PERSISTENT: Expectation(
        "peer replay: reproducible in place, not on a peer replica, in the same launch",
        "exit 17 + pre-iteration checkpoint + suspect_devices.json, relaunch elsewhere",
        EXIT_VALIDATION_FAILED,
        True,
    ),
    ChaosFault.GRAD_CORRUPTION: Expectation(
        "replica fingerprint of the all-reduced gradients inside the step (gated), rerun",
        "continue (no exit): transient corruption of that rank, the rerun's gradients",
        EXIT_OK,
        True,
    ),
    ChaosFault.HANG: Expectation(
        "hang watchdog: step section timeout, monitor kills the rank",
        "torchrun restart, resume from the last checkpoint",
        EXIT_OK,
        True,
    ),
    ChaosFault.SIGKILL: Expectation(
        "torchrun: worker failure (SIGKILL), restart",
        "torchrun restart, resume from the last checkpoint",
        EXIT_OK,
        True,
    ),
    ChaosFault.SIGTERM_LAUNCHER: Expectation(
        "exit signal handler: agreed graceful exit (reason signal)",
        "save at the stop iteration, exit 0, relaunch",
        EXIT_OK,
        True,
    ),
    ChaosFault.EXCEPTION: Expectation(
        "in-process restart: exception caught on one rank",
        "in-process restart (same processes), reload the last checkpoint",
        EXIT_OK,
        True,
    ),
    ChaosFault.REPEATABLE_FAULT: Expectation(
        "in-process restart: the same fault twice",
        "give up (no endless retries), exit 75 for the launcher",
        EXIT_INPROCESS_GAVE_UP,
        False,
    ),
    ChaosFault.SIGKILL_ASYNC_SAVE: Expectation(
        "torchrun: worker failure (SIGKILL) during an uncommitted async save",
        "torchrun restart, resume from the previous complete checkpoint",
        EXIT_OK,
        True,
    ),
    ChaosFault.CORRUPT_CHECKPOINT: Expectation(
        "checkpoint load: CheckpointError naming the path",
        "exit 2 without --ckpt-fallback; relaunch with --ckpt-fallback from the previous one",
        EXIT_BAD_INPUT,
        True,
    ),
    ChaosFault.DISK_FULL: Expectation(
        "checkpoint save: write fails (EFBIG), CheckpointError",
        "exit 2, nothing committed; relaunch after space is freed",
        EXIT_BAD_INPUT,
        True,
    ),
    ChaosFault.CONCURRENT_JOB: Expectation(
        "save-directory lock: the second job is refused, naming the holder",
        "the second job exits 2 touching nothing; the first commits and finishes",
        EXIT_BAD_INPUT,
        True,
    ),
    ChaosFault.CORRUPT_METADATA: Expectation(
        "restricted unpickler: the planted .metadata is refused (its payload never runs)",
        "exit 2 without --ckpt-fallback; relaunch with --ckpt-fallback from the previous one",
        EXIT_BAD_INPUT,
        True,
    ),
    ChaosFault.TORN_METRICS: Expectation(
        "metrics sink: the torn last record is dropped on open (one warning)",
        "resume; every metrics line parses, no record lost",
        EXIT_OK,
        True,
    ),
}


_AT_A_SAVE = (
    ChaosFault.SIGKILL_ASYNC_SAVE,
    ChaosFault.CORRUPT_CHECKPOINT,
    ChaosFault.CONCURRENT_JOB,
    ChaosFault.CORRUPT_METADATA,
)


@dataclass(frozen=True)
class FaultPlan:
    """Where one fault strikes.

    ``iteration`` is 1-based (the number the training log, ``--error-injection-iterations`` and
    the tracker file use) for every kind. For the checkpoint kinds it is the
    iteration whose checkpoint is hit (a multiple of the save interval).
    """

    kind: ChaosFault
    iteration: int
    rank: int


def parse_faults(value: str | None) -> list[ChaosFault]:
    """``--faults a,b,c`` (or ``all``/None) -> kinds in campaign order, duplicates removed."""
    if value is None or value.strip() in ("", "all"):
        return list(ChaosFault)
    wanted: list[ChaosFault] = []
    for raw in value.split(","):
        name = raw.strip().lower().replace("-", "_")
        try:
            kind = ChaosFault(name)
        except ValueError:
            allowed = ", ".join(k.value for k in ChaosFault)
            raise ValueError(f"--faults: unknown fault {raw!r}; allowed: all, {allowed}") from None
        if kind not in wanted:
            wanted.append(kind)
    return wanted


def validate_shape(iterations: int, save_interval: int, nproc: int) -> None:
    """ValueError naming the flag when the job is too short for every fault to have room."""
    if save_interval < 2:
        raise ValueError(f"--save-interval: must be >= 2, got {save_interval}")
    if iterations < 3 * save_interval:
        raise ValueError(
            f"--iterations: must be >= 3 x --save-interval ({3 * save_interval}), got {iterations}"
        )
    if nproc < 2:
        raise ValueError(f"--nproc-per-node: must be >= 2 (faults hit one rank), got {nproc}")


def build_schedule(
    kinds: list[ChaosFault], seed: int, iterations: int, save_interval: int, nproc: int
) -> list[FaultPlan]:
    """One `FaultPlan` per kind, drawn from ``--seed`` and the kind (pure, reproducible).

    Step faults strike strictly after the first checkpoint and before the last iteration, so a
    resume has a checkpoint and work to redo; checkpoint faults hit a save that has an older
    complete checkpoint before it.
    """
    validate_shape(iterations, save_interval, nproc)
    step_range = range(save_interval + 1, iterations)
    saves = [i for i in range(2 * save_interval, iterations, save_interval)]
    plans: list[FaultPlan] = []
    for kind in kinds:
        # One stream per kind: a fault strikes at the same place whatever else is scheduled.
        rng = random.Random(f"{seed}:{kind.value}")
        iteration, rank = rng.choice(step_range), rng.randrange(nproc)
        save_it = rng.choice(saves)
        if kind in _AT_A_SAVE:
            # Rank 0 commits saves (and holds the lock): the kinds that hit a save hit rank 0.
            plans.append(FaultPlan(kind, save_it, 0))
        elif kind in (ChaosFault.DISK_FULL, ChaosFault.TORN_METRICS):
            plans.append(FaultPlan(kind, save_it - save_interval, 0))  # the last good save
        else:
            plans.append(FaultPlan(kind, iteration, rank))
    return plans
