"""Helpers shared by the benchmark scripts (imported as a sibling: run them as
``python bench/<script>.py``, which puts this directory on ``sys.path``)."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Steppable(Protocol):
    """A benchmark variant: a name, a trainer to close, and ``run(iters)``."""

    name: str
    trainer: Any

    def run(self, iters: int) -> None: ...


def sync(device: torch.device) -> None:
    """Wait for the device (timing boundaries); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (0..1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def rotated_windows(
    variants: Sequence[Steppable], rounds: int, iters: int, device: torch.device
) -> dict[str, list[float]]:
    """ms per iteration of each variant, one window of ``iters`` per round, timed from a device
    sync to a device sync, the order rotated every round (side by side in one process)."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        order = list(variants[r % len(variants) :]) + list(variants[: r % len(variants)])
        for v in order:
            sync(device)
            start = time.perf_counter()
            v.run(iters)
            sync(device)
            times[v.name].append((time.perf_counter() - start) * 1e3 / iters)
    return times


def close_all(variants: Sequence[Steppable], device: torch.device) -> None:
    """Close every variant's trainer and give the device its memory back (the next preset)."""
    for v in variants:
        v.trainer.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def paired_rows(times: dict[str, list[float]], base: str = "off") -> list[dict[str, Any]]:
    """Per variant: median ms and its p10-p90, and the per-round ratio to ``base`` (median,
    mean, p10-p90): each round's windows ran back to back, so the ratio cancels slow drifts."""
    rows = []
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t, times[base], strict=True)]
        rows.append(
            {
                "variant": name,
                "median_ms": statistics.median(t),
                "p10_ms": percentile(t, 0.1),
                "p90_ms": percentile(t, 0.9),
                "ratio": statistics.median(ratios),
                "ratio_mean": statistics.fmean(ratios),
                "ratio_p10": percentile(ratios, 0.1),
                "ratio_p90": percentile(ratios, 0.9),
            }
        )
    return rows


def add_step_args(parser: argparse.ArgumentParser, *, iters: int, rounds: int, warmup: int) -> None:
    """The flags every trainer-stepping benchmark takes (device, precision, micro-batches,
    timed windows, extra trainer flags, a JSON output)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=iters, help="iterations per timed window")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed iterations per variant")
    parser.add_argument("--extra", default="", help="more trainer flags for every variant")
    parser.add_argument("--json", default=None)


def pin_device(args: argparse.Namespace) -> None:
    """``--device cuda`` means the first GPU, set current (graphs and pinned copies use it)."""
    if args.device == "cuda":
        torch.cuda.set_device(0)
        args.device = "cuda:0"
