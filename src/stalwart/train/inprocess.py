"""``--inprocess-restart`` for the reference trainer: each attempt builds a fresh `Trainer`."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch.distributed as dist

from stalwart.checkpoint.in_memory import InMemorySnapshots
from stalwart.checkpoint.non_persistent import NonPersistentType
from stalwart.compile import CompileActivity, CompileCache, NullCompileCache
from stalwart.config.run import RunConfig
from stalwart.distributed.launch_env import env_int
from stalwart.distributed.process_group import DistributedContext, choose_device, init_distributed
from stalwart.reliability.inprocess.policy import FailureKind
from stalwart.reliability.inprocess.store import RestartStore, StoreAddress
from stalwart.reliability.inprocess.wrapper import (
    Attempt,
    InProcessRestarter,
    InProcessRestartExhausted,
    RestartOptions,
)
from stalwart.train.build import build_compile_cache
from stalwart.train.trainer import Trainer, TrainOutcome


def trainer_attempt(
    config: RunConfig,
    compile_cache: CompileCache | NullCompileCache | None = None,
    compiling: Callable[[], object] | None = None,
    snapshots: InMemorySnapshots | None = None,
) -> Callable[[Attempt], TrainOutcome]:
    """The train function of one attempt: build a Trainer from ``config``, resume, train.

    Nothing of an attempt survives it: the Trainer (model, optimizer, data position, rerun state
    machine, timers, async checkpoint writer, CUDA graphs) is rebuilt and resumes from the newest
    complete checkpoint. What outlives the attempts is ``compile_cache``, owned by the caller
    (outside the restartable scope), and the compiled code Dynamo keeps on the model's code
    objects: the rebuilt model passes the same guards, so a restarted attempt compiles nothing
    and only re-captures its CUDA graphs. ``snapshots`` (``--non-persistent-ckpt-type
    in_memory``) outlive the attempts too: a restarted attempt resumes from the newest one
    every rank holds when it is newer than the checkpoints on disk, and reads no file. On a fault
    the wrapper first discards an in-flight async save without collectives (abort), then closes the
    Trainer (finalize).
    """

    def body(attempt: Attempt) -> TrainOutcome:
        trainer = Trainer(
            config,
            attempt.ctx,
            attempt=attempt.index,
            compile_cache=compile_cache,
            snapshots=snapshots,
        )
        attempt.on_abort(functools.partial(_record_hang, attempt, trainer))
        attempt.on_abort(functools.partial(trainer.checkpointer.close, abort=True))
        # Graphs that captured NCCL collectives keep the communicator referenced: drop them
        # (idempotent, safe from the monitor's thread) before the process groups are aborted;
        # the main thread's next graph call then fails on the torn-down context.
        attempt.before_process_group_abort(trainer.step.close)
        attempt.on_finalize(trainer.close)
        # ``compiling`` (a CompileActivity): a running compile is progress, not a hang.
        attempt.set_progress(lambda: trainer.state.iteration, activity=compiling)
        outcome = trainer.train()
        trainer.close()
        return outcome

    return body


def _record_hang(attempt: Attempt, trainer: Trainer) -> None:
    """A watchdog failure (no progress for --inprocess-soft-timeout) is a hang in the goodput
    ledger: the interrupted step's time becomes hang-until-detected, not lost work."""
    record = attempt.monitor.store.failure(attempt.index)
    if record is not None and record.kind is FailureKind.WATCHDOG:
        trainer.shell.ledger.fault("hang", record.message)


def build_restarter(config: RunConfig) -> InProcessRestarter:
    """The restarter for the current launcher: a TCP store hosted by rank 0, or a local one."""
    use_cpu, timeout_s = config.training.use_cpu, config.training.distributed_timeout_minutes * 60
    device = choose_device(env_int("LOCAL_RANK", 0), use_cpu)
    options = RestartOptions.from_config(config.inprocess, no_retry=(ValueError,))
    world = env_int("WORLD_SIZE", 1, minimum=1)
    if world > 1:
        rank = env_int("RANK", 0, maximum=world - 1)
        store = RestartStore(
            StoreAddress.from_env(), rank, world, timeout_s=options.barrier_timeout
        )
    else:
        store = RestartStore.local()

    def init_group(group_store: dist.Store) -> DistributedContext:
        return init_distributed(use_cpu=use_cpu, timeout_s=timeout_s, store=group_store)

    return InProcessRestarter(options, init_group, store=store, device=device)


def run_training_inprocess(config: RunConfig) -> tuple[int, TrainOutcome | None]:
    """Train with in-process restart; (exit code, outcome or None when it gave up). The compile
    cache is opened once, outside the attempts, and passed to each."""
    restarter = build_restarter(config)
    cache = build_compile_cache(config, env_int("RANK", 0))
    activity = CompileActivity() if config.training.compile else None
    in_memory = config.checkpoint.non_persistent_ckpt_type is NonPersistentType.IN_MEMORY
    snapshots = InMemorySnapshots() if in_memory else None
    try:
        with cache:
            outcome = restarter.run(trainer_attempt(config, cache, activity, snapshots))
    except InProcessRestartExhausted as exc:
        sys.stderr.write(f"stalwart train: {exc}\n")
        return exc.exit_code, None
    finally:
        if activity is not None:
            activity.close()
        if snapshots is not None:
            snapshots.release()
    return outcome.exit_code, outcome
