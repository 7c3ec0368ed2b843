"""What one fault of a campaign produced, and the checks that decide whether it behaved."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.chaos.compare import chain_problems, params_equal
from stalwart.chaos.runner import LaunchResult, LaunchSpec, run
from stalwart.chaos.schedule import EXPECTED, ChaosFault, FaultPlan
from stalwart.checkpoint import layout
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import GOODPUT_FILE, Bucket, summarize
from stalwart.reliability.exit import read_exit_reason


@dataclass
class FaultResult:
    """One row of the campaign table (the ``--json`` keys first, then context)."""

    kind: str
    detected: bool = False
    mechanism: str = ""
    recovered: bool = False
    seconds_to_recover: float | None = None
    iterations_redone: int | None = None
    bitwise_equal: bool | None = None
    exit_code: int | None = None
    expected_exit_code: int = 0
    recovery: str = ""
    iteration: int = 0
    rank: int = 0
    launch_exit_codes: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    goodput: GoodputCost | None = None

    @property
    def passed(self) -> bool:
        return not self.problems

    def check(self, ok: bool, problem: str) -> bool:
        """Record ``problem`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.problems.append(problem)
        return ok

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["passed"] = self.passed
        out["goodput"] = None if self.goodput is None else self.goodput.to_json()
        if out["seconds_to_recover"] is not None:
            out["seconds_to_recover"] = round(out["seconds_to_recover"], 2)
        out["wall_seconds"] = round(out["wall_seconds"], 1)
        return out


# The buckets a recovery path costs (the rest is what the fault-free run spends too).
RECOVERY_BUCKETS = (Bucket.RESTART, Bucket.HANG, Bucket.LOST_WORK, Bucket.RERUN)


@dataclass(frozen=True)
class GoodputCost:
    """A faulted job's ledger (every launch of it in one ``--save``): goodput and what the
    recovery path cost, in seconds and in percent of the job's wall time."""

    goodput: float
    wall_s: float
    recovery_s: float
    seconds: dict[str, float]

    @property
    def recovery_pct(self) -> float:
        return 100.0 * self.recovery_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput_pct": round(100.0 * self.goodput, 2),
            "wall_s": round(self.wall_s, 2),
            "recovery_s": round(self.recovery_s, 2),
            "recovery_pct": round(self.recovery_pct, 2),
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
        }


def goodput_cost(run_dir: Path) -> GoodputCost | None:
    """The ledger of ``run_dir`` summarized; None when the job wrote none."""
    file = read_ledger(run_dir / GOODPUT_FILE)
    if not file.records:
        return None
    summary = summarize(file)
    recovery = sum(summary.seconds[b] for b in RECOVERY_BUCKETS)
    seconds = {b.value: s for b, s in summary.seconds.items()}
    return GoodputCost(summary.goodput, summary.wall_s, recovery, seconds)


@dataclass
class Context:
    """The campaign's job shape, shared by every scenario."""

    work: Path
    base_args: list[str]  # model/training flags without --save
    nproc: int
    iterations: int
    save_interval: int
    reference: Path  # the fault-free run's --save directory
    timeout: float = 300.0

    def spec(self, save: Path, extra: list[str], **kw: Any) -> LaunchSpec:
        return LaunchSpec([*self.base_args, "--save", str(save), *extra], self.nproc, **kw)

    def launch(self, plan: FaultPlan, name: str, spec: LaunchSpec) -> LaunchResult:
        return run(spec, self.work / plan.kind.value / f"{name}.log", self.timeout)

    def save_dir(self, plan: FaultPlan) -> Path:
        return self.work / plan.kind.value / "ckpt"

    def last_save_before(self, iteration: int) -> int:
        """The newest periodic checkpoint at or before ``iteration`` (completed iterations)."""
        return (iteration // self.save_interval) * self.save_interval


def new_result(plan: FaultPlan) -> FaultResult:
    exp = EXPECTED[plan.kind]
    return FaultResult(
        kind=plan.kind.value,
        expected_exit_code=exp.exit_code,
        recovery=exp.recovery,
        iteration=plan.iteration,
        rank=plan.rank,
    )


def detect(res: FaultResult, kind: ChaosFault, ok: bool, what: str) -> None:
    """Mark the fault detected by its intended mechanism when ``ok``."""
    res.detected = ok
    res.mechanism = EXPECTED[kind].mechanism if ok else f"NOT DETECTED ({what})"
    res.check(ok, f"not detected by the intended mechanism: {what}")


def exit_reason(save: Path) -> dict[str, Any]:
    record, _ = read_exit_reason(save)
    return record or {}


def count_redone(launches: list[LaunchResult], seeded: int = 0) -> int:
    """Iterations trained more than once (``seeded``: iterations 1..seeded done before the first
    launch, by a copied checkpoint chain) plus in-place reruns of the rerun state machine."""
    counts: Counter[int] = Counter(range(1, seeded + 1))
    reruns = 0
    for launch in launches:
        counts.update(it for _, it in launch.iterations())
        reruns += launch.text.count("Need to rerun iteration")
    return sum(c - 1 for c in counts.values()) + reruns


def finish_recoverable(
    ctx: Context,
    res: FaultResult,
    save: Path,
    launches: list[LaunchResult],
    recovery_s: float | None,
    seeded: int = 0,
) -> FaultResult:
    """The end of every recoverable fault: records ``recovery_s`` and the iterations
    ``launches`` redid (``seeded``: see `count_redone`), then checks the last launch finished,
    bitwise equal to the fault-free run, with a readable chain. Returns ``res``."""
    res.seconds_to_recover = recovery_s
    res.iterations_redone = count_redone(launches, seeded=seeded)
    final, it = launches[-1], ctx.iterations
    res.recovered = final.code == 0 and exit_reason(save).get("reason") == "finished"
    res.check(res.recovered, f"the job did not finish (launcher exit {final.code})")
    last = save / layout.iteration_dir_name(it)
    if last.is_dir():
        equal, why = params_equal(last, ctx.reference / layout.iteration_dir_name(it))
        res.bitwise_equal = equal
        res.check(equal, f"final parameters differ from the fault-free run: {why}")
    else:
        res.bitwise_equal = False
        res.check(False, f"no final checkpoint {last}")
    check_chain(res, save)
    return res


def check_resumed(res: FaultResult, launch: LaunchResult, expected: int, who: str) -> None:
    """``launch`` resumed exactly once, at iteration ``expected`` (``who`` names it)."""
    resumes = [it for _, _, it in launch.resumes()]
    res.check(resumes == [expected], f"{who} resumed at {resumes}, expected [{expected}]")


def relaunch(
    ctx: Context,
    res: FaultResult,
    plan: FaultPlan,
    name: str,
    spec: LaunchSpec,
    expected: int,
    who: str = "relaunch",
) -> LaunchResult:
    """The operator's next launch after the faulted one (log ``name``): its exit code joins
    the row's, and it must resume exactly once, at iteration ``expected``."""
    launch = ctx.launch(plan, name, spec)
    res.launch_exit_codes.append(launch.code)
    check_resumed(res, launch, expected, who)
    return launch


def check_chain(res: FaultResult, save: Path) -> None:
    for problem in chain_problems(save):
        res.check(False, f"checkpoint chain: {problem}")
    leftovers = layout.list_tmp_dirs(str(save))
    res.check(not leftovers, f"partial checkpoint directories left behind: {leftovers}")


def seed_from_reference(ctx: Context, save: Path, iteration: int) -> None:
    """Make ``save`` hold the fault-free chain up to ``iteration`` (as if a job had stopped
    there)."""
    save.mkdir(parents=True, exist_ok=True)
    for it in layout.list_complete_checkpoints(str(ctx.reference)):
        if it <= iteration:
            name = layout.iteration_dir_name(it)
            shutil.copytree(ctx.reference / name, save / name)
    layout.write_tracker_atomic(str(save), iteration)


def resumed_at(launch: LaunchResult) -> tuple[float, int] | None:
    """(time, iteration) of the first "resumed from" line of a launch."""
    resumes = launch.resumes()
    return (resumes[0][0], resumes[0][2]) if resumes else None


def recovery_seconds(
    fault_time: float | None, launch: LaunchResult, after: float = 0.0
) -> float | None:
    """From ``fault_time`` to the first training-log line after the first resume at/after
    ``after``."""
    if fault_time is None:
        return None
    resume = next(((t, it) for t, _, it in launch.resumes() if t >= after), None)
    if resume is None:
        return None
    done = launch.first_iteration_after(resume[0], resume[1])
    return None if done is None else done - fault_time
