"""What one node costs inside a replayed CUDA graph, by pattern (H200 measurement aid).

Each pattern is repeated ``--reps`` times in one captured graph; the graph is replayed ``--iters``
times and timed with CUDA events (median). Reported per repetition: replay time, the kernel time
from torch.profiler (device events, summed) and the difference (graph execution overhead).

    PYTHONPATH=src python3 bench/graph_node_costs.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

ROWS, COLS = 2048, 256


def patterns(grad: torch.Tensor, out: torch.Tensor) -> dict[str, Callable[[], None]]:
    """Bias-gradient-like reductions and an elementwise baseline, all on fixed buffers."""
    chunks = 16
    return {
        "elementwise add_": lambda: out.add_(1.0),
        "sum(0) (one global reduce)": lambda: out.copy_(grad.sum(0)),
        "two-stage sum": lambda: out.copy_(grad.view(chunks, -1, COLS).sum(1).sum(0)),
        "sum over a (2048, 256) view, dim 1": lambda: out[:1].copy_(grad.sum()),
    }


def time_graph(func: Callable[[], None], reps: int, iters: int) -> tuple[float, float]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            func()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            func()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernel_us = sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return statistics.median(times), kernel_us / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    grad = torch.randn(ROWS, COLS, device="cuda", dtype=torch.float32)
    out = torch.zeros(COLS, device="cuda", dtype=torch.float32)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| pattern | replay us/rep | kernel us/rep | overhead us/rep |")
    print("|---|---|---|---|")
    for name, func in patterns(grad, out).items():
        replay, kernel = time_graph(func, args.reps, args.iters)
        print(f"| {name} | {replay:.2f} | {kernel:.2f} | {replay - kernel:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
