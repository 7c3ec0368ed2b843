"""A chaos campaign: the fault-free reference run, then every scheduled fault, then the verdict.

Usage::

    config = CampaignConfig(work_dir=Path("runs/chaos"), faults=list(ChaosFault), seed=0)
    outcome = run_campaign(config, print)
    outcome.passed, outcome.to_json()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.chaos.files import FILE_SCENARIOS
from stalwart.chaos.peer import PEER_SCENARIOS
from stalwart.chaos.result import (
    Context,
    FaultResult,
    GoodputCost,
    exit_reason,
    goodput_cost,
    new_result,
)
from stalwart.chaos.runner import LaunchSpec, run
from stalwart.chaos.scenarios import SCENARIOS
from stalwart.chaos.schedule import EXPECTED, ChaosFault, FaultPlan, build_schedule
from stalwart.chaos.storage import STORAGE_SCENARIOS

# The job every scenario trains: a ~0.6M-parameter GPT, one log line per iteration.
MODEL_FLAGS = [
    "--preset",
    "tiny",
    "--num-layers",
    "1",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "32",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--no-progress-bar",
]
Scenario = Callable[[Context, FaultPlan], FaultResult]
ALL_SCENARIOS: dict[ChaosFault, Scenario] = {
    **SCENARIOS,
    **PEER_SCENARIOS,
    **STORAGE_SCENARIOS,
    **FILE_SCENARIOS,
}


@dataclass
class CampaignConfig:
    """``stalwart chaos`` flags."""

    work_dir: Path
    faults: list[ChaosFault]
    seed: int = 0
    iterations: int = 12
    save_interval: int = 3
    nproc: int = 2
    use_cpu: bool = True
    timeout: float = 300.0
    jobs: int = 1  # scenarios run at once


@dataclass
class CampaignOutcome:
    """Verdict and rows; ``reference_dir`` holds the fault-free run (and ``chaos.json``)."""

    faults: list[FaultResult]
    reference_dir: Path
    seconds: float
    schedule: list[FaultPlan] = field(default_factory=list)
    reference_problem: str | None = None
    reference_goodput: GoodputCost | None = None

    @property
    def passed(self) -> bool:
        return self.reference_problem is None and all(f.passed for f in self.faults)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "seconds": round(self.seconds, 1),
            "reference_problem": self.reference_problem,
            "reference_goodput": (
                None if self.reference_goodput is None else self.reference_goodput.to_json()
            ),
            "faults": [f.to_json() for f in self.faults],
        }


def base_args(config: CampaignConfig) -> list[str]:
    gbs = 4 * config.nproc  # one micro-batch of 4 per rank
    return [
        *MODEL_FLAGS,
        "--train-iters",
        str(config.iterations),
        "--seed",
        str(config.seed + 1),
        "--global-batch-size",
        str(gbs),
        "--save-interval",
        str(config.save_interval),
        *(["--use-cpu"] if config.use_cpu else []),
    ]


def run_reference(ctx: Context) -> str | None:
    """The fault-free run; None when it finished with a full checkpoint chain."""
    save = ctx.reference
    result = run(
        LaunchSpec([*ctx.base_args, "--save", str(save)], ctx.nproc),
        ctx.work / "reference" / "run.log",
        ctx.timeout,
    )
    if result.code != 0 or exit_reason(save).get("reason") != "finished":
        return f"fault-free run failed (exit {result.code}); see {ctx.work / 'reference'}"
    return None


def run_one(ctx: Context, plan: FaultPlan) -> FaultResult:
    """Run one scenario; an unexpected error in the harness is a failed row, not a crash."""
    started = time.monotonic()
    try:
        res = ALL_SCENARIOS[plan.kind](ctx, plan)
    except Exception as exc:
        res = new_result(plan)
        res.problems.append(f"chaos harness error: {type(exc).__name__}: {exc}")
    res.wall_seconds = time.monotonic() - started
    res.goodput = goodput_cost(ctx.save_dir(plan))
    expected = EXPECTED[plan.kind]
    res.check(
        res.exit_code == expected.exit_code,
        f"exit code {res.exit_code}, documented {expected.exit_code}",
    )
    if not expected.recoverable:
        res.check(res.bitwise_equal is None, "an unrecoverable fault reported bitwise_equal")
        res.check(not res.recovered, "an unrecoverable fault reported recovered")
    return res


def run_campaign(config: CampaignConfig, say: Callable[[str], None]) -> CampaignOutcome:
    """Reference run, then each scheduled fault in order; ``say`` gets one line per step."""
    started = time.monotonic()
    schedule = build_schedule(
        config.faults, config.seed, config.iterations, config.save_interval, config.nproc
    )
    ctx = Context(
        work=config.work_dir,
        base_args=base_args(config),
        nproc=config.nproc,
        iterations=config.iterations,
        save_interval=config.save_interval,
        reference=config.work_dir / "reference" / "ckpt",
        timeout=config.timeout,
    )
    say(f"chaos: fault-free reference run ({config.iterations} iterations, {config.nproc} ranks)")
    problem = run_reference(ctx)
    results: list[FaultResult] = []
    if problem is not None:
        say(f"chaos: {problem}")
    if problem is None:
        results = _run_scenarios(ctx, schedule, config.jobs, say)
    return CampaignOutcome(
        results,
        ctx.reference,
        time.monotonic() - started,
        schedule,
        reference_problem=problem,
        reference_goodput=goodput_cost(ctx.reference),
    )


def _run_scenarios(
    ctx: Context, schedule: list[FaultPlan], jobs: int, say: Callable[[str], None]
) -> list[FaultResult]:
    """Every scenario, ``jobs`` at a time; rows in schedule order.

    Scenarios are independent (each has its own save directory and ``torchrun --standalone``
    picks a free port), and much of a scenario is waiting (a hang's timeout, a relaunch, a held
    commit), so running two or three at once shortens a campaign even on two cores.
    """

    def one(plan: FaultPlan) -> FaultResult:
        say(f"chaos: {plan.kind.value} at iteration {plan.iteration} on rank {plan.rank} ...")
        res = run_one(ctx, plan)
        verdict = "ok" if res.passed else "FAILED: " + "; ".join(res.problems)
        say(f"chaos: {plan.kind.value}: {verdict} ({res.wall_seconds:.0f} s)")
        return res

    if jobs <= 1:
        return [one(plan) for plan in schedule]
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="chaos") as pool:
        return list(pool.map(one, schedule))


COLUMNS = (
    "kind",
    "iteration",
    "rank",
    "detected",
    "mechanism",
    "recovered",
    "seconds_to_recover",
    "iterations_redone",
    "bitwise_equal",
    "exit_code",
    "passed",
)
# From each faulted job's goodput ledger: recovery = restart + hang + lost work + rerun seconds.
GOODPUT_COLUMNS = ("goodput_pct", "recovery_s", "recovery_pct")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _goodput_cells(cost: GoodputCost | None) -> list[str]:
    if cost is None:
        return ["-", "-", "-"]
    return [f"{100 * cost.goodput:.1f}", f"{cost.recovery_s:.1f}", f"{cost.recovery_pct:.1f}"]


def format_table(outcome: CampaignOutcome, markdown: bool = False) -> str:
    """The campaign table (plain text for stdout, or Markdown for docs)."""
    rows = [
        [_cell(f.to_json()[c]) for c in COLUMNS] + _goodput_cells(f.goodput) for f in outcome.faults
    ]
    header = [*COLUMNS, *GOODPUT_COLUMNS]
    if outcome.reference_goodput is not None:
        reference = ["reference (no fault)"] + ["-"] * (len(COLUMNS) - 1)
        rows.insert(0, reference + _goodput_cells(outcome.reference_goodput))
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in rows]
    verdict = "PASSED" if outcome.passed else "FAILED"
    lines.append(f"\nchaos campaign {verdict} in {outcome.seconds:.0f} s")
    return "\n".join(lines)
