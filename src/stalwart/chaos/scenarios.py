"""One function per fault kind of the rerun state machine and of the processes: how to launch,
inject, recover and verify. Checkpoint and storage faults are in ``storage.py``.

Every function takes the campaign `Context` and a `FaultPlan`, runs the faulted job (and the
relaunch the documented recovery path needs), and returns a `FaultResult` whose ``problems``
list every way the fault did not behave as documented.
"""

from __future__ import annotations

import json

from stalwart.chaos.injection import error_injection, inject
from stalwart.chaos.result import (
    Context,
    FaultResult,
    check_chain,
    check_resumed,
    count_redone,
    detect,
    exit_reason,
    finish_recoverable,
    new_result,
    recovery_seconds,
    relaunch,
)
from stalwart.chaos.runner import LaunchResult
from stalwart.chaos.schedule import ChaosFault, FaultPlan

HANG_STEP_TIMEOUT_S = 3.0
FT_FLAGS = [
    "--enable-ft",
    "--ft-num-warmup-iters",
    "2",
    "--ft-timeouts",
    f"setup=180,step={HANG_STEP_TIMEOUT_S:g},checkpointing=180,out_of_section=180",
]


def transient_nan(ctx: Context, plan: FaultPlan) -> FaultResult:
    """NaN observed once on one rank: the in-place rerun is clean, exit 17 without a checkpoint;
    the operator relaunches (without the fault) from the last periodic checkpoint."""
    res, save = new_result(plan), ctx.save_dir(plan)
    first = ctx.launch(plan, "1-fault", ctx.spec(save, error_injection("transient_error", plan)))
    res.launch_exit_codes.append(first.worker_code())
    detect(res, plan.kind, "Possible transient error!" in first.text, "no transient diagnosis")
    res.exit_code = exit_reason(save).get("exit_code", first.worker_code())
    return _relaunch_from_last_save(ctx, res, plan, first, [], "Unexpected result")


def _relaunch_from_last_save(
    ctx: Context,
    res: FaultResult,
    plan: FaultPlan,
    first: LaunchResult,
    args: list[str],
    fault_marker: str,
) -> FaultResult:
    """The operator's relaunch (with ``args``) after a launch that exited on the fault: it must
    resume from the last periodic checkpoint before the fault and end equal to the reference."""
    save = ctx.save_dir(plan)
    expected = ctx.last_save_before(plan.iteration - 1)
    second = relaunch(ctx, res, plan, "2-relaunch", ctx.spec(save, args), expected)
    recovery = recovery_seconds(first.first_time(fault_marker), second)
    return finish_recoverable(ctx, res, save, [first, second], recovery)


def persistent_nan(ctx: Context, plan: FaultPlan) -> FaultResult:
    """NaN reproduced by the in-place rerun: exit 16 with a checkpoint; the relaunch on "another
    device" (``STALWART_DEVICE_ID``) does not reproduce it: persistent error, exit 17 (the end)."""
    res, save = new_result(plan), ctx.save_dir(plan)
    # Megatron's flow (the peer replay would decide in the first launch: ``peer_persistent``).
    args = [*error_injection("persistent_error", plan), "--no-rerun-peer-replay"]
    first = ctx.launch(
        plan, "1-device-a", ctx.spec(save, args, env={"STALWART_DEVICE_ID": "chaos-device-a"})
    )
    res.launch_exit_codes.append(exit_reason(save).get("exit_code", first.worker_code()))
    res.check(res.launch_exit_codes[0] == 16, f"first launch exit {res.launch_exit_codes[0]} != 16")
    res.check("Saving a checkpoint and exiting now" in first.text, "no checkpoint-and-exit message")
    check_chain(res, save)
    second = ctx.launch(
        plan, "2-device-b", ctx.spec(save, args, env={"STALWART_DEVICE_ID": "chaos-device-b"})
    )
    res.exit_code = exit_reason(save).get("exit_code", second.worker_code())
    res.launch_exit_codes.append(res.exit_code)
    detect(
        res,
        plan.kind,
        "Possible persistent error!" in second.text and res.launch_exit_codes[0] == 16,
        "no persistent-error diagnosis after the device change",
    )
    res.iterations_redone = count_redone([first, second])
    check_chain(res, save)
    return res


def spiky_loss(ctx: Context, plan: FaultPlan) -> FaultResult:
    """A reproducible loss spike on one rank (``correct_result`` injection into the spiky-loss
    check, the only validation call here): non-fatal, the job continues without exiting."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = [
        "--no-check-for-nan-in-loss-and-grad",
        "--check-for-spiky-loss",
        *error_injection("correct_result", plan),
    ]
    run = ctx.launch(plan, "1-fault", ctx.spec(save, args))
    res.launch_exit_codes.append(run.code)
    res.exit_code = run.code
    spotted = any("Unexpected result" in line and "Spiky loss" in line for _, line in run.lines)
    continued = "Continuing normal execution because the failed validation was not fatal"
    detect(res, plan.kind, spotted and continued in run.text, "no non-fatal spiky-loss event")
    start, end = run.first_time("Unexpected result"), run.first_time(continued)
    recovery = None if start is None or end is None else end - start
    return finish_recoverable(ctx, res, save, [run], recovery)


def silent_corruption(ctx: Context, plan: FaultPlan) -> FaultResult:
    """One bit of one weight flips on one rank (``--inject-fault bitflip``): nothing errors, but
    the replica fingerprints (inside the step of the next checked iteration, before its optimizer
    step, or before the next save) find the diverged weights, exit 17 without saving;
    the relaunch resumes from the last checkpoint, which was checked when it was written."""
    res, save = new_result(plan), ctx.save_dir(plan)
    check = ["--check-weight-hash-across-dp-replicas-interval", str(ctx.save_interval)]
    first = ctx.launch(plan, "1-fault", ctx.spec(save, [*check, *inject("bitflip", plan)]))
    record = exit_reason(save)
    res.exit_code = record.get("exit_code", first.worker_code())
    res.launch_exit_codes.append(res.exit_code if res.exit_code is not None else first.code)
    caught_at = int(record.get("iteration", -1))
    detect(
        res,
        plan.kind,
        # Caught inside the step of the flipped iteration itself (the in-step fingerprint of the
        # weights: exit_reason counts the completed iterations, K - 1) or by a later check.
        record.get("reason") == "replica_mismatch" and plan.iteration - 1 <= caught_at,
        f"exit reason {record}",
    )
    res.check(
        caught_at <= plan.iteration - 1 + ctx.save_interval,
        f"caught at {caught_at}, after the first save following the flip at {plan.iteration}",
    )
    return _relaunch_from_last_save(ctx, res, plan, first, check, "FAULT INJECTION")


def hang(ctx: Context, plan: FaultPlan) -> FaultResult:
    """One rank sleeps inside a step: its hang watchdog dumps the stack and kills it after the
    ``step`` timeout; torchrun restarts the job, which resumes from the last checkpoint."""
    res, save = new_result(plan), ctx.save_dir(plan)
    run = ctx.launch(
        plan, "1-fault", ctx.spec(save, [*FT_FLAGS, *inject("hang", plan)], max_restarts=1)
    )
    res.launch_exit_codes.append(run.code)
    res.exit_code = run.code
    # Its peer blocks in the same step's collective, so both watchdogs fire within milliseconds;
    # whichever kills its rank first makes torchrun tear the other down, maybe before that one's
    # report is written. Either rank's ``step`` report is the intended mechanism.
    reports = sorted((save / "ft_logs").glob("ft_hang_rank*.json"))
    sections = {p.name: json.loads(p.read_text()).get("section") for p in reports}
    detect(res, plan.kind, "step" in sections.values(), f"hang reports: {sections or 'none'}")
    return _restarted(ctx, res, plan, run)


def sigkill(ctx: Context, plan: FaultPlan) -> FaultResult:
    """SIGKILL of one rank inside a step: torchrun sees exit -9, restarts, resume from the last
    checkpoint."""
    res, save = new_result(plan), ctx.save_dir(plan)
    run = ctx.launch(plan, "1-fault", ctx.spec(save, inject("sigkill", plan), max_restarts=1))
    res.launch_exit_codes.append(run.code)
    res.exit_code = run.code
    # torchrun names the first failure it notices: the killed rank's -9, or its peer's abort on
    # the broken gloo connection; either way a worker failure after the kill triggers the restart.
    fired = run.first_time("FAULT INJECTION")
    detect(res, plan.kind, fired is not None and bool(run.worker_exits), f"{run.worker_exits}")
    return _restarted(ctx, res, plan, run)


def _restarted(ctx: Context, res: FaultResult, plan: FaultPlan, run: LaunchResult) -> FaultResult:
    """The end of a fault the job recovers from in one launch (torchrun's restart or the
    in-process one): it resumed from the last checkpoint before the fault and finished."""
    check_resumed(res, run, ctx.last_save_before(plan.iteration - 1), "restart")
    recovery = recovery_seconds(run.first_time("FAULT INJECTION"), run)
    return finish_recoverable(ctx, res, ctx.save_dir(plan), [run], recovery)


def sigterm_launcher(ctx: Context, plan: FaultPlan) -> FaultResult:
    """SIGTERM to torchrun (a preemption): it forwards SIGTERM to every worker; the signal
    handler makes all ranks agree to save and exit 0 at the same iteration; the relaunch resumes
    there without losing an iteration."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = ["--exit-signal-handler", *inject("sigterm", plan)]
    first = ctx.launch(plan, "1-fault", ctx.spec(save, args))
    record = exit_reason(save)
    stopped = int(record.get("iteration", -1))
    res.exit_code = record.get("exit_code", first.worker_code())
    res.launch_exit_codes.append(res.exit_code if res.exit_code is not None else first.code)
    detect(res, plan.kind, record.get("reason") == "signal", f"exit reason {record}")
    res.check(stopped >= plan.iteration - 1, f"stopped at {stopped} before the signal")
    second = relaunch(ctx, res, plan, "2-relaunch", ctx.spec(save, []), stopped)
    recovery = recovery_seconds(first.first_time("FAULT INJECTION"), second)
    return finish_recoverable(ctx, res, save, [first, second], recovery)


def exception(ctx: Context, plan: FaultPlan) -> FaultResult:
    """An exception inside one rank's step: in-process restart catches it, rebuilds the process
    group in the same processes and reloads the last checkpoint."""
    res, save = new_result(plan), ctx.save_dir(plan)
    run = ctx.launch(
        plan, "1-fault", ctx.spec(save, ["--inprocess-restart", *inject("exception", plan)])
    )
    res.launch_exit_codes.append(run.code)
    res.exit_code = run.code
    needle = f"in-process restart attempt 1: rank {plan.rank} failed at iteration {plan.iteration}"
    detect(res, plan.kind, needle in run.text, f"no '{needle}'")
    return _restarted(ctx, res, plan, run)


def repeatable_fault(ctx: Context, plan: FaultPlan) -> FaultResult:
    """The same exception at every attempt: in-process restart gives up after seeing it twice
    and exits 75 (for the launcher) instead of retrying forever."""
    res, save = new_result(plan), ctx.save_dir(plan)
    args = [
        "--inprocess-restart",
        "--inprocess-max-iterations",
        "3",
        "--inject-fault-repeat",
        *inject("exception", plan),
    ]
    run = ctx.launch(plan, "1-fault", ctx.spec(save, args))
    res.exit_code = run.worker_code()
    res.launch_exit_codes.append(res.exit_code)
    gave_up = "giving up: the same fault happened twice" in run.text
    detect(res, plan.kind, gave_up, "no give-up message")
    res.check("in-process restart attempt 3" not in run.text, "a third attempt was made")
    res.iterations_redone = count_redone([run])
    check_chain(res, save)
    return res


SCENARIOS = {
    ChaosFault.TRANSIENT_NAN: transient_nan,
    ChaosFault.PERSISTENT_NAN: persistent_nan,
    ChaosFault.SPIKY_LOSS: spiky_loss,
    ChaosFault.SILENT_CORRUPTION: silent_corruption,
    ChaosFault.HANG: hang,
    ChaosFault.SIGKILL: sigkill,
    ChaosFault.SIGTERM_LAUNCHER: sigterm_launcher,
    ChaosFault.EXCEPTION: exception,
    ChaosFault.REPEATABLE_FAULT: repeatable_fault,
}
