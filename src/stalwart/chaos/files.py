"""Faults in the files a job shares or reads back: a second job on the same ``--save``, a DCP
``.metadata`` replaced by a code-running pickle, a torn last line of ``metrics.jsonl``. Same
contract as ``scenarios.py``.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

from stalwart.chaos.injection import hold_in_commit, in_commit
from stalwart.chaos.result import (
    Context,
    FaultResult,
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

# Job A sleeps this long inside its commit window while job B starts and tries the directory.
# It must outlast B's start-up (import torch, build) on a loaded 2-core machine: 15 s did not.
HOLD_S = 45.0
MARKER_NAME = "PWNED"  # what the planted payload would create if it ever ran


class _Payload:
    """Unpickling this runs ``code`` (how a hostile file executes on a plain pickle.load)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (self.code,)


def hostile_pickle(marker: Path) -> bytes:
    """A pickle that writes ``marker`` when loaded by an unrestricted unpickler."""
    return pickle.dumps(_Payload(f"open({str(marker)!r}, 'w').write('pwned')"))


def concurrent_job(ctx: Context, plan: FaultPlan) -> FaultResult:
    """Job B starts on job A's ``--save`` while A is inside the commit window of checkpoint k:
    B is refused (exit 2, one line naming A's host and pid) and touches nothing; A commits and
    finishes bitwise equal to the fault-free run."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k, prev = plan.iteration, plan.iteration - ctx.save_interval
    hold = hold_in_commit(k, f"{HOLD_S:g}")
    job_a = Job(ctx.spec(save, hold), ctx.work / plan.kind.value / "1-job-a.log")
    try:
        caught = job_a.wait_for(in_commit(save, k, prev), ctx.timeout)
        started_b = time.time()
        second = ctx.launch(plan, "2-job-b", ctx.spec(save, []))
        partial_kept = bool(list(save.glob(f"{layout.iteration_dir_name(k)}*")))
        overlapped = job_a.proc.poll() is None  # B ended while A still held the directory
    finally:
        first = finish(job_a, ctx.timeout)
    res.check(caught, f"job A was never caught inside the commit of iteration {k}")
    res.check(overlapped, f"job A finished before job B did: raise HOLD_S ({HOLD_S:g} s)")
    res.exit_code = second.worker_code()
    res.launch_exit_codes += [res.exit_code, first.code]
    refusal = [line for _, line in second.lines if "is in use by another job" in line]
    detect(res, plan.kind, bool(refusal) and "pid" in refusal[0], "job B was not refused")
    res.check(not second.iterations(), "job B trained on a directory in use")
    res.check(partial_kept, f"job A's save of iteration {k} was deleted by job B")
    recovery = (second.ended - started_b) if refusal else None
    return finish_recoverable(ctx, res, save, [first], recovery)


def corrupt_metadata(ctx: Context, plan: FaultPlan) -> FaultResult:
    """The newest checkpoint's DCP ``.metadata`` is replaced by a pickle whose loading would run
    code: the restricted unpickler refuses it (exit 2 naming the file; the payload never runs);
    with ``--ckpt-fallback`` the job resumes from the previous checkpoint, bitwise equal."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k, prev = plan.iteration, plan.iteration - ctx.save_interval
    seed_from_reference(ctx, save, k)
    marker = ctx.work / plan.kind.value / MARKER_NAME
    newest = save / layout.iteration_dir_name(k)
    (newest / layout.DCP_METADATA_FILENAME).write_bytes(hostile_pickle(marker))
    first = ctx.launch(plan, "1-no-fallback", ctx.spec(save, []))
    res.exit_code = first.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    named = any(
        "checkpoint error" in ln and "metadata" in ln and "not allowed" in ln
        for _, ln in first.lines
    )
    detect(res, plan.kind, named and not marker.exists(), "no refusal of the planted .metadata")
    res.check(not first.iterations(), "training ran on a checkpoint with planted metadata")
    fallback = ctx.spec(save, ["--ckpt-fallback"])
    second = relaunch(ctx, res, plan, "2-fallback", fallback, prev, "fallback")
    res.check(not marker.exists(), "the planted pickle ran")
    recovery = recovery_seconds(first.started, second)
    return finish_recoverable(ctx, res, save, [first, second], recovery, seeded=k)


def _train_records(path: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r for r in records if r.get("split") == "train"]


def torn_metrics(ctx: Context, plan: FaultPlan) -> FaultResult:
    """A crash left half a record at the end of ``metrics.jsonl``: the resume drops it (one
    warning) and its own first record is a line of its own; every line parses afterwards."""
    res, save = new_result(plan), ctx.save_dir(plan)
    k = plan.iteration
    seed_from_reference(ctx, save, k)
    metrics = save / "metrics.jsonl"
    kept = [r for r in _train_records(ctx.reference / "metrics.jsonl") if int(r["iteration"]) <= k]
    torn = json.dumps({"split": "train", "iteration": k + 1, "loss": 1.0})[:25]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in kept) + torn, encoding="utf-8")
    run = ctx.launch(plan, "1-resume", ctx.spec(save, []))
    res.exit_code = run.code
    res.launch_exit_codes.append(run.code)
    detect(res, plan.kind, "dropped a torn last record" in run.text, "no torn-tail warning")
    try:
        logged = [int(r["iteration"]) for r in _train_records(metrics)]
    except ValueError as exc:
        logged = []
        res.check(False, f"metrics.jsonl still has an unreadable line: {exc}")
    expected = list(range(1, ctx.iterations + 1))
    res.check(logged == expected, f"metrics.jsonl iterations {logged}, expected {expected}")
    recovery = recovery_seconds(run.started, run)
    return finish_recoverable(ctx, res, save, [run], recovery, seeded=k)


FILE_SCENARIOS = {
    ChaosFault.CONCURRENT_JOB: concurrent_job,
    ChaosFault.CORRUPT_METADATA: corrupt_metadata,
    ChaosFault.TORN_METRICS: torn_metrics,
}
