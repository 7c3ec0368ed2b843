"""A user's own loop on ``GuardedStep`` produces the goodput ledger and straggler times too.

The rerun state machine's replay lands in the ledger's ``rerun`` bucket (the step is given the
ledger), the rejected iteration is not counted as done; under a full-iteration graph (the CPU
fake backend captures by running the body once) the straggler's compute regions recorded at
capture are what the report reads, and evaluation passes never replace them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.graphs import make_capturable_adamw
from stalwart.loop import GraphPlan, GuardedStep
from stalwart.loop.observer import StepObserver
from stalwart.observability.dumps import NullTensorDumper
from stalwart.observability.goodput import Bucket, GoodputLedger
from stalwart.observability.memory_release import NullMemoryRelease
from stalwart.observability.straggler import StragglerDetector
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator, RerunStateMachine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

STEP_S = 0.02


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 1, generator=gen)}
            for _ in range(n)]  # fmt: skip


def _machine(tmp_path: Path) -> RerunStateMachine:
    config = RerunConfig(result_rejected_tracker_filename=str(tmp_path / "tracker.txt"))
    return RerunStateMachine(
        mode=config.mode,
        result_rejected_tracker_filename=config.result_rejected_tracker_filename,
        checks=config.checks,
        device="cpu",
    )


def test_a_users_loop_books_the_replay_as_rerun(tmp_path) -> None:
    model = nn.Linear(6, 1)
    calls = {"n": 0}

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        time.sleep(STEP_S)
        loss = nn.functional.mse_loss(m(batch["x"]), batch["y"])
        calls["n"] += 1
        return loss * float("nan") if calls["n"] == 5 else loss  # iteration 3, once: transient

    ledger = GoodputLedger(tmp_path / "run", print_fn=lambda line: None)
    step = GuardedStep(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True),
        forward_step=forward, machine=_machine(tmp_path),
        data=RerunDataIterator(_batches(20)), num_microbatches=2, goodput=ledger,
    )  # fmt: skip
    done = 0
    for it in range(6):
        with ledger.step(it + 1) as span:
            result = step.run(it + 1, launch_next=it + 1 < 6)
            if result.verdict.exit:
                span.abandon(Bucket.RERUN)
        if result.verdict.exit:
            break
        done += 1
    summary = ledger.close("rerun")
    s = summary.seconds
    assert done == 2 and result.verdict.exit
    assert s[Bucket.RERUN] >= 2 * STEP_S  # the replay pass (and the rejected iteration)
    assert s[Bucket.PRODUCTIVE] >= 2 * 2 * STEP_S
    assert summary.sessions[0].last_iteration == 2  # the rejected iteration 3 is not done
    assert summary.wall_s == pytest.approx(summary.last - summary.first)


class FakeDeviceTiming:
    """The straggler's timing on the fake graph backend: regions read a device clock that the
    forward advances; regions recorded at capture keep their times (a replay re-records them)."""

    graph_events = True

    def __init__(self, context: FakeGraphContext) -> None:
        self.context, self.now_ms, self.graph_regions = context, 0.0, 0

    def capturing(self) -> bool:
        return self.context.capturing

    def begin(self, in_graph: bool) -> Any:
        self.graph_regions += in_graph
        return [self.now_ms, None]

    def end(self, region: Any) -> None:
        region[1] = self.now_ms

    def elapsed_ms(self, regions: list[Any]) -> float:
        return sum(r[1] - r[0] for r in regions)

    def release(self, regions: list[Any]) -> None:
        return None


def test_straggler_regions_live_in_the_captured_graph_and_evaluation_stays_out(tmp_path) -> None:
    context = FakeGraphContext()
    timing = FakeDeviceTiming(context)
    detector = StragglerDetector(torch.device("cpu"), timing=timing)
    model = nn.Linear(6, 1)

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        timing.now_ms += 3.0  # each micro-batch: 3 ms of "device" compute
        return nn.functional.mse_loss(m(batch["x"]), batch["y"])

    step = GuardedStep(
        model=model,
        optimizer=make_capturable_adamw(list(model.parameters()), lr=0.01,
                                        device=torch.device("cpu"), fused=True),
        forward_step=forward, machine=_machine(tmp_path), data=RerunDataIterator(_batches(40)),
        num_microbatches=2, plan=GraphPlan(context=context, warmup_steps=1,
                                           optimizer_graph=False),
        observer=StepObserver(detector, NullTensorDumper(), NullMemoryRelease()), lookahead=False,
    )  # fmt: skip
    for it in range(4):  # warm-up, capture (+ its replay), two replays
        step.run(it + 1, launch_next=False)
        detector.step()
    assert timing.graph_regions == 2  # one per micro-batch, recorded once, at capture
    step.evaluate(iter(_batches(8)), eval_iters=2, num_microbatches=2)  # forward only
    assert timing.graph_regions == 2  # evaluation's capture recorded no training regions
    report = detector.report(4)
    assert report.source == "graph-events"
    assert report.compute_ms == [pytest.approx(6.0)]  # not 0 ms under the graph
    step.close()


FB_S, OPT_S, LOOP_S, STARTUP_S = 1.0, 0.5, 0.25, 2.0


@pytest.mark.parametrize("lookahead", [False, True], ids=["no-lookahead", "lookahead"])
def test_one_rejected_iteration_buckets_computed_by_hand(tmp_path, lookahead: bool) -> None:
    """A fake clock advanced by the phases themselves (each micro-batch's forward 1 s, each
    optimizer step 0.5 s, the loop 0.25 s between iterations): iterations 1 and 2 are accepted,
    iteration 3's first pass has a NaN (transient: the replay is clean, exit 17). Its first pass
    is not productive (it was: the replay's span closed it as productive): the whole iteration
    is ``rerun``, and productive holds exactly the two accepted iterations. With the look-ahead,
    iteration 3's first micro-batch runs inside iteration 2 (launched ahead): it is iteration
    3's, ``rerun`` too (it was booked with iteration 2, productive)."""
    now = [STARTUP_S]
    model = nn.Linear(6, 1)
    calls, steps = {"n": 0}, {"n": 0}

    class ClockedAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            now[0] += OPT_S
            steps["n"] += 1
            return super().step(closure)

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        now[0] += FB_S
        calls["n"] += 1
        loss = nn.functional.mse_loss(m(batch["x"]), batch["y"])
        return loss * float("nan") if calls["n"] == 5 else loss  # iteration 3's first pass

    ledger = GoodputLedger(tmp_path / "run", print_fn=lambda line: None, launcher_start=0.0,
                           restart_count=0, clock=lambda: now[0])  # fmt: skip
    step = GuardedStep(
        model=model, optimizer=ClockedAdamW(model.parameters(), fused=True),
        forward_step=forward, machine=_machine(tmp_path),
        data=RerunDataIterator(_batches(20)), num_microbatches=2, goodput=ledger,
        lookahead=lookahead,
    )  # fmt: skip
    steps_before = 0
    for it in range(3):
        steps_before = steps["n"]
        with ledger.step(it + 1) as span:
            result = step.run(it + 1, launch_next=it + 1 < 3)
            if result.verdict.exit:
                span.abandon(Bucket.RERUN)
        if result.verdict.exit:
            break
        now[0] += LOOP_S  # logging, the exit decision
    summary = ledger.close("rerun")
    assert (it, result.verdict.exit_code) == (2, 17)
    assert step.num_used == (2 if lookahead else 0)
    rejected_steps = steps["n"] - steps_before  # gated steps the device skipped in iteration 3
    s = summary.seconds
    assert s[Bucket.STARTUP] == pytest.approx(STARTUP_S)
    assert s[Bucket.PRODUCTIVE] == pytest.approx(2 * (2 * FB_S + OPT_S + LOOP_S))
    assert s[Bucket.RERUN] == pytest.approx(2 * 2 * FB_S + rejected_steps * OPT_S)
    assert s[Bucket.LOST_WORK] == 0.0
    assert summary.sessions[0].last_iteration == 2
    assert summary.wall_s == pytest.approx(now[0])
    assert sum(s.values()) == pytest.approx(now[0])
