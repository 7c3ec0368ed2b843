"""On the device: each timer holds its phase's device work, under real CUDA graphs too.

Device-side delays (``torch.cuda._sleep`` kernels) in the forward step (``FB_MS`` per iteration,
split over the micro-batches) and in the optimizer's step (``OPT_MS``, captured into the
optimizer graph and replayed on its second stream when overlapped). ``forward-backward`` and
``optimizer`` must each hold their own delay: eager and graphed (full-iteration graph + optimizer
graph), with and without the look-ahead, in ``EVENTS`` mode (CUDA events: device time, the end
event of an overlapped step recorded on its stream) and in ``SYNC`` mode (Megatron's). With
the step inside the full-iteration graph, ``EVENTS`` mode splits each replay at an external
event pair captured in the graph; ``SYNC`` mode cannot (``forward-backward`` holds both).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpu_only import GPU_ONLY
from stalwart.loop import EagerPlan, GraphPlan, GuardedStep
from stalwart.observability.timer_names import FORWARD_BACKWARD, OPTIMIZER, TRAINING_TIMERS
from stalwart.observability.timers import Timers, TimingMode
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

pytestmark = GPU_ONLY

FB_MS, OPT_MS = 20.0, 12.0
NUM_MICROBATCHES = 2
WARMUP, MEASURED = 6, 8


def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` spins for clock cycles: measure how many make a millisecond."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up (module load)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _run(
    graphed: bool, lookahead: bool, mode: TimingMode, in_graph: bool = False
) -> dict[str, float]:
    device = torch.device("cuda")
    per_ms = _cycles_per_ms()
    fb_cycles = int(FB_MS * per_ms / NUM_MICROBATCHES)
    opt_cycles = int(OPT_MS * per_ms)

    class SlowAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            torch.cuda._sleep(opt_cycles)  # device work of the step (captured in its graph)
            return super().step(closure)

    def forward(batch: dict[str, torch.Tensor], m: nn.Module) -> torch.Tensor:
        torch.cuda._sleep(fb_cycles)
        return nn.functional.mse_loss(m(batch["x"]), batch["y"])

    torch.manual_seed(0)
    model = nn.Linear(16, 1).to(device)
    params = list(model.parameters())
    lr: Any = torch.tensor(1e-3, device=device) if graphed else 1e-3
    optimizer = SlowAdamW(params, lr=lr, fused=True, capturable=graphed)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 16, generator=gen).to(device),
                "y": torch.randn(4, 1, generator=gen).to(device)}
               for _ in range(NUM_MICROBATCHES * (WARMUP + MEASURED + 2))]  # fmt: skip
    timers = Timers(log_level=2, mode=mode, device=device)
    plan = (
        GraphPlan(warmup_steps=2, optimizer_warmup_steps=2, optimizer_in_graph=in_graph)
        if graphed
        else EagerPlan()
    )
    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=forward,
        machine=RerunConfig().build(device), data=RerunDataIterator(batches),
        num_microbatches=NUM_MICROBATCHES, plan=plan, timers=timers, lookahead=lookahead,
    )  # fmt: skip
    names = timers.enabled_names(TRAINING_TIMERS)
    for it in range(WARMUP + MEASURED):
        if it == WARMUP:  # warm-up and capture iterations are not measured
            timers.report(names, reset=True)
        # Steady state: every measured iteration launches the next (the window gains the last
        # one's launch and lacks the first one's: each pass counted once).
        result = step.run(it + 1, launch_next=True)
        assert not result.skipped
    report = timers.report(names, normalizer=MEASURED)
    used = step.num_used
    step.close()
    torch.cuda.synchronize()
    if lookahead:
        assert used >= MEASURED - 1
    assert report is not None
    return {name: hi for name, (_, hi) in report.min_max().items()}


@pytest.mark.parametrize("mode", [TimingMode.EVENTS, TimingMode.SYNC], ids=lambda m: m.value)
@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no-lookahead"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphs"])
def test_each_timer_holds_its_device_delay(
    graphed: bool, lookahead: bool, mode: TimingMode
) -> None:
    ms = _run(graphed, lookahead, mode)
    assert FB_MS * 0.95 <= ms[FORWARD_BACKWARD] < FB_MS + 0.5 * OPT_MS, ms
    assert OPT_MS * 0.95 <= ms[OPTIMIZER] < OPT_MS + 0.5 * FB_MS, ms


def test_the_step_inside_the_graph_is_split_at_its_boundary_event_in_events_mode() -> None:
    """``--cuda-graph-include-optimizer``, ``EVENTS`` mode: the external event pair recorded
    inside the captured graph around the step moves its device time from ``forward-backward``
    (graph start -> boundary) to ``optimizer`` (boundary -> graph end)."""
    ms = _run(True, False, TimingMode.EVENTS, in_graph=True)
    assert FB_MS * 0.95 <= ms[FORWARD_BACKWARD] < FB_MS + 0.5 * OPT_MS, ms
    assert OPT_MS * 0.95 <= ms[OPTIMIZER] < OPT_MS + 0.5 * FB_MS, ms


def test_the_step_inside_the_graph_is_in_forward_backward_in_sync_mode() -> None:
    """``SYNC`` mode (host clock): one replay cannot be split, so ``forward-backward`` holds both
    delays (the log says so) and ``optimizer`` has no figure for those passes."""
    ms = _run(True, False, TimingMode.SYNC, in_graph=True)
    assert (FB_MS + OPT_MS) * 0.95 <= ms[FORWARD_BACKWARD] < FB_MS + 1.5 * OPT_MS, ms
    assert OPTIMIZER not in ms, ms
