"""Chaos kinds of the attribution in one launch (issue 15): a persistent fault on one rank
diagnosed by a peer replica, and a finite silent corruption of one rank's gradient."""

from __future__ import annotations

import json

from stalwart.chaos.result import (
    Context,
    FaultResult,
    check_chain,
    count_redone,
    detect,
    exit_reason,
    finish_recoverable,
    new_result,
    recovery_seconds,
)
from stalwart.chaos.schedule import ChaosFault, FaultPlan


def peer_persistent(ctx: Context, plan: FaultPlan) -> FaultResult:
    """``persistent_error`` on one rank with ``--rerun-peer-replay``: reproducible in place, not
    on the peer: one launch saves the pre-iteration state, names the rank's device in
    ``suspect_devices.json`` and exits 17; the relaunch on other hardware (no fault) resumes that
    state and ends bitwise equal to the fault-free run."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = ["--rerun-peer-replay", "--error-injection-rate", "1", "--error-injection-type",
            "persistent_error", "--error-injection-iterations", str(plan.iteration),
            "--error-injection-ranks", str(plan.rank)]  # fmt: skip
    first = ctx.launch(plan, "1-fault", ctx.spec(save, args))  # devices cpu:<local rank>
    res.exit_code = exit_reason(save).get("exit_code", first.worker_code())
    res.launch_exit_codes.append(res.exit_code)
    suspects_file = save / "suspect_devices.json"
    try:
        suspects = [s["rank"] for s in json.loads(suspects_file.read_text())["suspects"]]
    except (OSError, ValueError, KeyError, TypeError):
        suspects = []
    detect(
        res,
        plan.kind,
        "Peer replay verdict" in first.text and suspects == [plan.rank],
        f"no peer-replay verdict naming rank {plan.rank} (suspect_devices.json: {suspects})",
    )
    check_chain(res, save)
    second = ctx.launch(plan, "2-other-hardware", ctx.spec(save, [], env={"STALWART_DEVICE_ID": "chaos-b"}))  # fmt: skip
    res.launch_exit_codes.append(second.code)
    resumes = [it for _, _, it in second.resumes()]
    res.check(
        resumes == [plan.iteration - 1], f"relaunch resumed at {resumes}, not {plan.iteration - 1}"
    )
    res.seconds_to_recover = recovery_seconds(first.first_time("Unexpected result"), second)
    res.iterations_redone = count_redone([first, second])
    finish_recoverable(ctx, res, save, second)
    return res


def grad_corruption(ctx: Context, plan: FaultPlan) -> FaultResult:
    """One high mantissa bit of one all-reduced gradient element flips on one rank, once
    (``--inject-fault grad_corruption``): finite, no NaN check sees it; the in-step replica
    fingerprint (``--check-weight-hash-sample-fraction 1``) gates the step, the rerun agrees
    across replicas (a transient corruption of that rank), training goes on without a relaunch
    and ends bitwise equal to the fault-free run."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = ["--check-weight-hash-sample-fraction", "1", "--inject-fault", "grad_corruption",
            "--inject-fault-iteration", str(plan.iteration),
            "--inject-fault-rank", str(plan.rank)]  # fmt: skip
    run = ctx.launch(plan, "1-fault", ctx.spec(save, args))
    res.exit_code = run.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    named = f"transient corruption on rank {plan.rank} "
    detect(res, plan.kind, named in run.text, f"no transient replica mismatch on rank {plan.rank}")
    res.seconds_to_recover = recovery_seconds(run.first_time("FAULT INJECTION"), run)
    res.iterations_redone = count_redone([run])
    finish_recoverable(ctx, res, save, run)
    return res


PEER_SCENARIOS = {
    ChaosFault.PEER_PERSISTENT: peer_persistent,
    ChaosFault.GRAD_CORRUPTION: grad_corruption,
}
