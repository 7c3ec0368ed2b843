"""Each timer measures its own phase: injected, known per-phase delays come back in their timers.

A forward step that sleeps ``FB_S`` per iteration (split over the micro-batches) and an optimizer
whose ``step`` sleeps ``OPT_S``: ``forward-backward`` must hold the first and ``optimizer`` the
second, with and without the look-ahead (which runs the next iteration's first micro-batch, or
its whole graphed pass, before this iteration's read), eagerly and under the graph plan on the
CPU fake backend: warming up forever (the graph's body runs every pass) and captured (a replay
lasts as long as its captured body, as a synchronized device replay would). The look-ahead's
work used to land in no timer (forward-backward 0.02 ms on the CPU demo).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.loop import EagerPlan, GraphPlan, GuardedStep
from stalwart.observability.timer_names import (
    FORWARD_BACKWARD,
    FORWARD_COMPUTE,
    OPTIMIZER,
    OPTIMIZER_INNER_STEP,
    TRAINING_TIMERS,
)
from stalwart.observability.timers import Timers
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

FB_S, OPT_S = 0.100, 0.080  # well above the host overhead of a loaded 2-core machine (~10 ms)
WARMUP, MEASURED = 4, 4
EAGER_FOREVER = 10**6


class SlowAdamW(torch.optim.AdamW):
    """A fused AdamW (gated, so the look-ahead runs) whose step takes ``OPT_S`` more."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(OPT_S)
        return super().step(closure)


def _run(plan: str, lookahead: bool, num_microbatches: int) -> dict[str, float]:
    """Per-iteration milliseconds of every enabled timer over the measured iterations."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        time.sleep(FB_S / num_microbatches)
        return nn.functional.mse_loss(m(batch["x"]), batch["y"])

    params = list(model.parameters())
    graph_plan: EagerPlan | GraphPlan = EagerPlan()
    if plan == "eager":
        optimizer = SlowAdamW(params, lr=0.01, fused=True)
    else:
        optimizer = SlowAdamW(
            params, lr=torch.tensor(0.01), capturable=True, fused=True
        )  # as make_capturable_adamw(fused=True)
        warmup = EAGER_FOREVER if plan == "graph_warmup" else 2
        graph_plan = GraphPlan(
            context=FakeGraphContext(timed_replay=True),
            warmup_steps=warmup,
            optimizer_warmup_steps=warmup,
        )
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(2, 4, generator=gen), "y": torch.randn(2, 1, generator=gen)}
               for _ in range(num_microbatches * (WARMUP + MEASURED) + 4)]  # fmt: skip
    timers = Timers(log_level=2)
    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=forward,
        machine=RerunConfig().build(torch.device("cpu")), data=RerunDataIterator(batches),
        num_microbatches=num_microbatches, plan=graph_plan, timers=timers, lookahead=lookahead,
    )  # fmt: skip
    if plan == "graph_warmup":  # the fake graph never captures: allow the whole-pass launch
        step._lookahead.ready = lambda: True
    total = WARMUP + MEASURED
    for it in range(total):
        if it == WARMUP:  # warm-up and capture iterations are not measured
            timers.report(timers.enabled_names(TRAINING_TIMERS), reset=True)
        # Steady state: every measured iteration launches the next one, so the window holds
        # one launch it did not start with (the first's) and one it ends with (the next's).
        result = step.run(it + 1, launch_next=True)
        assert not result.skipped
    if lookahead:
        assert step.num_used >= MEASURED - 1  # the launches did happen
    report = timers.report(timers.enabled_names(TRAINING_TIMERS), normalizer=MEASURED)
    assert report is not None
    step.settle()
    return {name: hi for name, (_, hi) in report.min_max().items()}


CASES = [
    ("eager", True, 1),
    ("eager", True, 2),
    ("eager", False, 2),
    ("graph_warmup", True, 2),
    ("graph_warmup", False, 2),
    ("graph_captured", True, 2),
    ("graph_captured", False, 2),
]


@pytest.mark.parametrize(("plan", "lookahead", "num_microbatches"), CASES)
def test_each_timer_holds_its_injected_delay(
    plan: str, lookahead: bool, num_microbatches: int
) -> None:
    ms = _run(plan, lookahead, num_microbatches)
    fb, opt = 1000 * FB_S, 1000 * OPT_S
    # At least the injected delay (a sleep never returns early), and not the other phase's.
    assert fb * 0.97 <= ms[FORWARD_BACKWARD] < fb + 0.6 * opt, ms
    assert opt * 0.97 <= ms[OPTIMIZER] < opt + 0.6 * fb, ms
    if plan == "eager":  # level-2 and optimizer breakdown timers run outside graphs only
        assert fb * 0.97 <= ms[FORWARD_COMPUTE] <= ms[FORWARD_BACKWARD] + 1.0, ms
        assert opt * 0.97 <= ms[OPTIMIZER_INNER_STEP] <= ms[OPTIMIZER] + 1.0, ms


class _HostEvent:
    """A CUDA event's API on the host clock (the fake backend's device work is synchronous)."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1000.0


class _HostEventTiming:
    """``CudaEventTiming``'s region API over :class:`_HostEvent` (nothing is captured)."""

    graph_events = True

    def capturing(self) -> bool:
        return False

    def begin(self, in_graph: bool) -> Any:
        region = (_HostEvent(), _HostEvent())
        region[0].record()
        return region

    def end(self, region: Any) -> None:
        region[1].record()


def _run_in_graph(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, split: bool
) -> dict[str, float]:
    if split:  # EVENTS mode's split, its events on the host clock
        from stalwart.loop import plans
        from stalwart.observability.timer_split import EventSplit

        def events_split(timers: Any) -> EventSplit:
            return EventSplit(timers, _HostEventTiming())  # type: ignore[arg-type]

        monkeypatch.setattr(plans, "make_phase_split", events_split)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        time.sleep(FB_S)
        return nn.functional.mse_loss(m(batch["x"]), batch["y"])

    optimizer = SlowAdamW(model.parameters(), lr=torch.tensor(0.01), capturable=True, fused=True)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(2, 4, generator=gen), "y": torch.randn(2, 1, generator=gen)}
               for _ in range(WARMUP + MEASURED + 2)]  # fmt: skip
    timers = Timers(log_level=2)
    with caplog.at_level(logging.INFO, logger="stalwart"):
        step = GuardedStep(
            model=model, optimizer=optimizer, forward_step=forward,
            machine=RerunConfig().build(torch.device("cpu")), data=RerunDataIterator(batches),
            num_microbatches=1, timers=timers,
            plan=GraphPlan(context=FakeGraphContext(timed_replay=True), warmup_steps=2,
                           optimizer_in_graph=True),
        )  # fmt: skip
    names = timers.enabled_names(TRAINING_TIMERS)
    for it in range(WARMUP + MEASURED):
        if it == WARMUP:
            timers.report(names, reset=True)
        step.run(it + 1, launch_next=True)
    report = timers.report(names, normalizer=MEASURED)
    assert report is not None
    return {name: hi for name, (_, hi) in report.min_max().items()}


SAYS_INCLUDED = "forward-backward includes the optimizer step inside the full-iteration graph"


def test_the_step_inside_the_graph_is_in_forward_backward_on_the_host_clock_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``GraphPlan(optimizer_in_graph=True)`` (``--cuda-graph-include-optimizer``), SYNC mode /
    host clock: one replay cannot be split, so ``forward-backward`` holds both delays, the
    log says so, and ``optimizer`` is not reported for those passes (it was, as ~0 ms)."""
    ms = _run_in_graph(monkeypatch, caplog, split=False)
    fb, opt = 1000 * FB_S, 1000 * OPT_S
    assert (fb + opt) * 0.97 <= ms[FORWARD_BACKWARD] < fb + opt + 0.5 * fb, ms
    assert OPTIMIZER not in ms, ms
    assert SAYS_INCLUDED in caplog.text


def test_the_step_inside_the_graph_is_split_at_its_boundary_event(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EVENTS mode: the boundary event recorded in the graph's body splits each pass, so
    ``forward-backward`` holds its delay and ``optimizer`` the step's (events here on the
    host clock: the fake backend's replay lasts as long as its captured body)."""
    ms = _run_in_graph(monkeypatch, caplog, split=True)
    fb, opt = 1000 * FB_S, 1000 * OPT_S
    assert fb * 0.97 <= ms[FORWARD_BACKWARD] < fb + 0.6 * opt, ms
    assert opt * 0.97 <= ms[OPTIMIZER] < opt + 0.6 * fb, ms
    assert SAYS_INCLUDED not in caplog.text
