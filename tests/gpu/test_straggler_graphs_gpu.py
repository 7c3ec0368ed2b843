"""A rank slowed on purpose inside a full-iteration CUDA graph is named by the straggler line.

One GPU, two processes sharing it (gloo for the report's gather): each captures the same
matmul iteration with ``FullIterationGraph``; rank 1's compute region also holds a
``torch.cuda._sleep`` kernel, captured into its graph. The captured compute regions use external
CUDA events, re-recorded by every replay, and are read at the log step.
"""

from __future__ import annotations

import pytest
import torch

from stalwart.graphs import FullIterationGraph, GraphContext
from stalwart.observability.straggler import StragglerDetector
from stalwart.observability.straggler_timing import event_supports_external

from dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SLEEP_CYCLES = 40_000_000  # ~20 ms at ~2 GHz
REPLAYS = 20


def _rank(rank: int, world_size: int) -> tuple[list[float], int, list[int], str]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    det = StragglerDetector(device, rank, world_size, threshold=1.2)
    weight = torch.randn(1024, 1024, device=device)

    def forward_backward(*, data_iterator, num_microbatches, **_):
        out = []
        for _ in range(num_microbatches):
            x = next(data_iterator)
            with det.compute():
                for _ in range(8):
                    x = (x @ weight).tanh_()
                if rank == 1:
                    torch.cuda._sleep(SLEEP_CYCLES // num_microbatches)  # the slow rank
            out.append(x.sum())
        return out

    graph = FullIterationGraph(forward_backward, context=GraphContext(device), warmup_steps=2)
    batches = [torch.randn(1024, 1024, device=device) for _ in range(2)]
    for it in range(1, 3 + REPLAYS + 1):
        with det.iteration_region():
            graph(data_iterator=iter(batches), num_microbatches=2)
        det.step()
        if it == 3:
            det.report(it)  # warm-up + capture interval
    report = det.report(3 + REPLAYS)
    line = " | ".join(f"{f.label}: {f.fmt.format(f.value)}" for f in report.fields())
    if rank == 0:
        print(f"\nstraggler line under graphs ({report.source}): {line}")
    return report.compute_ms, report.slowest[0][0], report.stragglers, report.source


def test_slow_rank_is_named_under_full_iteration_graphs() -> None:
    results = run_distributed(_rank, world_size=2)
    for compute_ms, slowest, stragglers, source in results:
        assert source == ("graph-events" if event_supports_external() else "iteration")
        assert compute_ms[0] > 0.0, "the graph's compute read 0 ms"
        assert compute_ms[1] > compute_ms[0] + 10.0, compute_ms
        assert slowest == 1 and stragglers == [1]
