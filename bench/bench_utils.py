"""Helpers shared by the benchmark scripts (imported as a sibling: run them as
``python bench/<script>.py``, which puts this directory on ``sys.path``)."""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    """Wait for the device (timing boundaries); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (0..1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
