"""Checkpoint and storage faults: SIGKILL during an async save, a corrupted newest checkpoint,
a full disk at save time. Same contract as ``scenarios.py``.

The last two start from a copy of the fault-free run's checkpoint chain up to the plan's
iteration (exactly the state a job that stopped there leaves), which saves a launch each.
"""

from __future__ import annotations

import os
import signal
import time

from stalwart.chaos.injection import hold_in_commit, in_commit
from stalwart.chaos.result import (
    Context,
    FaultResult,
    check_chain,
    detect,
    finish_recoverable,
    new_result,
    recovery_seconds,
    relaunch,
    seed_from_reference,
)
from stalwart.chaos.runner import Job, finish
from stalwart.chaos.schedule import ChaosFault, FaultPlan
from stalwart.checkpoint import layout

COMMIT_SLEEP_S = "1.5"  # widens the async commit window (--inject-fault-phase commit)
FSIZE_LIMIT = 256 * 1024  # bytes: metadata and small files fit, a model/optimizer shard does not


def sigkill_async_save(ctx: Context, plan: FaultPlan) -> FaultResult:
    """SIGKILL rank 0 (the committing rank) while the async save of ``plan.iteration`` is written
    but not committed: torchrun restarts, the job resumes from the previous complete checkpoint
    and the partial directory is never loaded (and removed by the next save)."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k, prev = plan.iteration, plan.iteration - ctx.save_interval
    spec = ctx.spec(save, ["--async-save", *hold_in_commit(k, COMMIT_SLEEP_S)], max_restarts=1)
    job = Job(spec, ctx.work / plan.kind.value / "1-fault.log")
    killed_at = None
    try:
        if job.wait_for(in_commit(save, k, prev), ctx.timeout):
            pid = job.worker_pid(0)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
    finally:
        run = finish(job, ctx.timeout)
    res.launch_exit_codes.append(run.code)
    res.exit_code = run.code
    res.check(killed_at is not None, f"the async save of iteration {k} was never caught in flight")
    # torchrun names the first failure it notices (the killed rank or its peer's abort).
    detect(res, plan.kind, bool(run.worker_exits), f"worker exits {run.worker_exits}")
    resumes = [it for t, _, it in run.resumes() if killed_at is not None and t >= killed_at]
    res.check(resumes[:1] == [prev], f"restart resumed at {resumes}, expected {prev}")
    recovery = recovery_seconds(killed_at, run, after=killed_at or 0.0)
    return finish_recoverable(ctx, res, save, [run], recovery)


def corrupt_checkpoint(ctx: Context, plan: FaultPlan) -> FaultResult:
    """The newest checkpoint's largest shard is truncated (a torn write): without
    ``--ckpt-fallback`` the job refuses it with exit 2 naming the path; with it, the job resumes
    from the previous checkpoint and finishes bitwise equal."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k, prev = plan.iteration, plan.iteration - ctx.save_interval
    seed_from_reference(ctx, save, k)
    newest = save / layout.iteration_dir_name(k)
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    first = ctx.launch(plan, "1-no-fallback", ctx.spec(save, []))
    res.exit_code = first.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    named = any("checkpoint error" in line and str(newest) in line for _, line in first.lines)
    detect(res, plan.kind, named, f"no checkpoint error naming {newest}")
    res.check(not first.iterations(), "training ran on a corrupted checkpoint")
    fallback = ctx.spec(save, ["--ckpt-fallback"])
    second = relaunch(ctx, res, plan, "2-fallback", fallback, prev, "fallback")
    res.check("--ckpt-fallback" in second.text, "no fallback warning")
    recovery = recovery_seconds(first.started, second)
    return finish_recoverable(ctx, res, save, [first, second], recovery, seeded=k)


def disk_full(ctx: Context, plan: FaultPlan) -> FaultResult:
    """Writes past a file-size limit fail (EFBIG, RLIMIT_FSIZE: "disk full" even for root) at the
    first save after ``plan.iteration``: clear error, exit 2, nothing committed, the previous
    checkpoint intact; the relaunch without the limit finishes bitwise equal."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k = plan.iteration
    seed_from_reference(ctx, save, k)
    first = ctx.launch(plan, "1-disk-full", ctx.spec(save, [], fsize_limit=FSIZE_LIMIT))
    res.exit_code = first.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    failed = [line for _, line in first.lines if "checkpoint error: saving checkpoint" in line]
    detect(res, plan.kind, bool(failed), "no checkpoint save error")
    res.check(any("File too large" in line for line in failed), f"error does not say why: {failed}")
    res.check(layout.read_tracker(str(save)) == k, "the tracker moved past the last good save")
    check_chain(res, save)  # the previous checkpoint intact, no partial directory left
    second = relaunch(ctx, res, plan, "2-relaunch", ctx.spec(save, []), k)
    recovery = recovery_seconds(first.first_time("checkpoint error"), second)
    return finish_recoverable(ctx, res, save, [first, second], recovery, seeded=k)


STORAGE_SCENARIOS = {
    ChaosFault.SIGKILL_ASYNC_SAVE: sigkill_async_save,
    ChaosFault.CORRUPT_CHECKPOINT: corrupt_checkpoint,
    ChaosFault.DISK_FULL: disk_full,
}
