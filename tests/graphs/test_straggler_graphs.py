"""Stragglers under full-iteration graphs, on CPU: the graph fake backend runs the body once at
capture (as real capture does) and replays run no Python; a fake device clock stands in for the
CUDA events. The real thing (external events on an H200) is tests/gpu/test_straggler_graphs_gpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]

from stalwart.graphs import FullIterationGraph
from stalwart.observability.straggler import StragglerDetector

from dist_utils import run_distributed

WARMUP = 2


class FakeDeviceTiming:
    """Regions read a fake device clock; graph regions keep what the capture recorded (a real
    replay re-records the same nodes with the replay's times)."""

    def __init__(self, context: FakeGraphContext, graph_events: bool = True) -> None:
        self.context, self.graph_events = context, graph_events
        self.now_ms = 0.0
        self.graph_regions_made = 0

    def capturing(self) -> bool:
        return self.context.capturing

    def begin(self, in_graph: bool) -> Any:
        self.graph_regions_made += in_graph
        return [self.now_ms, None]

    def end(self, region: Any) -> None:
        region[1] = self.now_ms

    def elapsed_ms(self, regions: list[Any]) -> float:
        return sum(r[1] - r[0] for r in regions)

    def release(self, regions: list[Any]) -> None:
        return None


def _job(rank: int, graph_events: bool, compute_ms: float, comm_ms: float, iterations: int):
    context = FakeGraphContext()
    timing = FakeDeviceTiming(context, graph_events)
    det = StragglerDetector(torch.device("cpu"), rank, timing=timing, threshold=1.2)

    def forward_backward(*, data_iterator, num_microbatches, **_: Any) -> list[torch.Tensor]:
        out = []
        for _ in range(num_microbatches):
            batch = next(data_iterator)
            with det.compute():
                timing.now_ms += compute_ms / num_microbatches  # forward + backward
                out.append(batch * 2)
        timing.now_ms += comm_ms  # the gradient all-reduce: not compute
        return out

    graph = FullIterationGraph(forward_backward, context=context, warmup_steps=WARMUP)
    for _ in range(iterations):
        with det.iteration_region():
            batches = iter([torch.ones(2), torch.ones(2)])
            graph(data_iterator=batches, num_microbatches=2)  # a replay runs no Python
        det.step()
    return det, timing, graph


def test_captured_regions_time_every_replay_and_are_read_at_the_log_step() -> None:
    det, timing, graph = _job(0, True, compute_ms=8.0, comm_ms=2.0, iterations=WARMUP + 4)
    assert graph.num_captures == 1 and timing.graph_regions_made == 2  # once, at capture
    report = det.report(iteration=WARMUP + 4)
    assert report.source == "graph-events"
    assert report.compute_ms == [pytest.approx(8.0)]  # not 0 ms under the graph
    # After capture the fake replays advance no clock, so the interval's iteration regions
    # hold the eager iterations only; comm is what is left of them.
    assert report.comm_ms is not None and report.num_iterations == WARMUP + 4


def test_without_external_events_the_whole_replay_is_timed() -> None:
    det, timing, _ = _job(0, False, compute_ms=8.0, comm_ms=2.0, iterations=WARMUP + 2)
    assert timing.graph_regions_made == 0  # nothing recorded inside the graph
    det.report(iteration=WARMUP + 2)  # the warm-up interval
    for _ in range(3):  # replays only: each is 10 ms on the (fake) device
        with det.iteration_region():
            timing.now_ms += 10.0
        det.step()
    report = det.report(iteration=WARMUP + 5)
    assert report.source == "iteration" and report.compute_ms == [pytest.approx(10.0)]
    assert report.comm_ms is None


def test_recapture_replaces_the_graphs_regions() -> None:
    context = FakeGraphContext()
    timing = FakeDeviceTiming(context)
    det = StragglerDetector(torch.device("cpu"), timing=timing)
    for ms in (5.0, 7.0):  # two captures (a workload change), different device times
        context.capturing = True
        with det.compute():
            timing.now_ms += ms
        context.capturing = False
        det.step()
    assert det.report(2).compute_ms == [pytest.approx(7.0)]


def _two_ranks(rank: int, world_size: int) -> tuple[list[float], int, list[float] | None]:
    compute = 20.0 if rank == 1 else 8.0  # rank 1 is slow inside the graph
    det, _, _ = _job(rank, True, compute, comm_ms=1.0, iterations=WARMUP + 3)
    report = det.report(iteration=WARMUP + 3)
    return report.compute_ms, report.slowest[0][0], report.stragglers


@pytest.mark.distributed
def test_slow_rank_under_graphs_is_named_from_device_times() -> None:
    for compute_ms, slowest, stragglers in run_distributed(_two_ranks, world_size=2):
        assert compute_ms == [pytest.approx(8.0), pytest.approx(20.0)]
        assert slowest == 1 and stragglers == [1]
