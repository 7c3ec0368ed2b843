"""Chaos kinds of the attribution in one launch (issue 15): a persistent fault on one rank
diagnosed by a peer replica, and a finite silent corruption of one rank's gradient."""

from __future__ import annotations

import json

from stalwart.chaos.injection import error_injection, inject
from stalwart.chaos.result import (
    Context,
    FaultResult,
    check_chain,
    detect,
    exit_reason,
    finish_recoverable,
    new_result,
    recovery_seconds,
    relaunch,
)
from stalwart.chaos.schedule import ChaosFault, FaultPlan


def peer_persistent(ctx: Context, plan: FaultPlan) -> FaultResult:
    """``persistent_error`` on one rank with ``--rerun-peer-replay``: reproducible in place, not
    on the peer: one launch saves the pre-iteration state, names the rank's device in
    ``suspect_devices.json`` and exits 17; the relaunch on other hardware (no fault) resumes that
    state and ends bitwise equal to the fault-free run."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = ["--rerun-peer-replay", *error_injection("persistent_error", plan)]
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
    other = ctx.spec(save, [], env={"STALWART_DEVICE_ID": "chaos-b"})
    second = relaunch(ctx, res, plan, "2-other-hardware", other, plan.iteration - 1)
    recovery = recovery_seconds(first.first_time("Unexpected result"), second)
    return finish_recoverable(ctx, res, save, [first, second], recovery)


def grad_corruption(ctx: Context, plan: FaultPlan) -> FaultResult:
    """One high mantissa bit of one all-reduced gradient element flips on one rank, once
    (``--inject-fault grad_corruption``): finite, no NaN check sees it; the in-step replica
    fingerprint (``--check-weight-hash-sample-fraction 1``) gates the step, the rerun agrees
    across replicas (a transient corruption of that rank), training goes on without a relaunch
    and ends bitwise equal to the fault-free run."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = ["--check-weight-hash-sample-fraction", "1", *inject("grad_corruption", plan)]
    run = ctx.launch(plan, "1-fault", ctx.spec(save, args))
    res.exit_code = run.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    named = f"transient corruption on rank {plan.rank} "
    detect(res, plan.kind, named in run.text, f"no transient replica mismatch on rank {plan.rank}")
    recovery = recovery_seconds(run.first_time("FAULT INJECTION"), run)
    return finish_recoverable(ctx, res, save, [run], recovery)


PEER_SCENARIOS = {
    ChaosFault.PEER_PERSISTENT: peer_persistent,
    ChaosFault.GRAD_CORRUPTION: grad_corruption,
}
