"""Host-side numerics: float comparison, determinism statistics and the large-value detector.

Everything here works on host floats; the state machine feeds it values read in its one
deliberate per-iteration sync, so nothing in this file touches a device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stalwart.reliability.rerun.types import COMPARISON_MATCH, COMPARISON_MISMATCH

logger = logging.getLogger(__name__)


def host_float(value: float | torch.Tensor) -> float:
    """A Python float; a tensor argument is read with ``.item()`` (a sync when it is on a
    device)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(()).item())
    return float(value)


def compare_floats(a: float | torch.Tensor, b: float | torch.Tensor) -> float:
    """Relative difference of two results: 0 means identical, ``inf`` means incomparable.

    * equal values, or both NaN -> 0;
    * exactly one NaN, any infinity that is not matched exactly (``+inf`` vs ``-inf``
      included) -> inf;
    * otherwise ``|a - b| / mean(|a|, |b|)``, bounded by 2 (so ``a == -b`` gives 2 instead of
      Megatron's ZeroDivisionError, and values near zero do not blow up).
    """
    x, y = host_float(a), host_float(b)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return COMPARISON_MATCH
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return COMPARISON_MISMATCH
    return abs(x - y) / ((abs(x) + abs(y)) / 2.0)


class QuickStats:
    """Cheap distribution summary of non-negative samples (relative differences).

    Zeros are only counted; non-zero samples go into a ring buffer of ``max_size`` entries.
    """

    PERCENTILES = (0.5, 0.9, 0.99, 0.999)

    def __init__(self, max_size: int = 100000) -> None:
        self.max_size = max_size
        self.reset()

    def reset(self) -> None:
        self.samples: list[float] = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0

    def record(self, x: float) -> None:
        if x == 0:
            self.zero_cnt += 1
            return
        if len(self.samples) < self.max_size:
            self.samples.append(x)
        else:
            self.samples[self.pos % self.max_size] = x
        self.pos += 1
        self.max = max(self.max, x)

    def combine(self, others: Iterable[QuickStats]) -> None:
        """Merge other summaries into this one (ring-buffer semantics when over ``max_size``)."""
        for other in others:
            self.zero_cnt += other.zero_cnt
            for x in other.samples:
                self.record(x)

    def print_stats(self) -> str:
        """One line, in Megatron's format."""
        n = len(self.samples)
        if n == 0:
            return f"{self.zero_cnt:,} samples, all identical"
        total = self.zero_cnt + n
        ordered = sorted(self.samples)

        def pct(p: float) -> str:
            idx = int(total * p) - self.zero_cnt
            return "0.0" if idx < 0 else f"{ordered[idx]:.3E}"

        avg = sum(ordered) / total
        parts = ", ".join(f"p{p * 100:g}= {pct(p)}" for p in self.PERCENTILES)
        return (
            f"{total:,}/{self.zero_cnt:,} total/identical samples, rel. variability: "
            f"avg= {avg:.3E}, {parts}, max: {self.max:.3E}"
        )


@dataclass
class LargeValueTracker:
    """Per-context state of ``is_unexpectedly_large``: the max over a sampling window, then
    frozen."""

    count: int = 0
    max_value: float = 0.0

    def check(self, value: float, threshold: float, context: str, num_samples: int) -> bool:
        v = abs(value)
        if math.isnan(v) or math.isinf(v):
            return False  # NaN/Inf have their own checks
        if self.count < num_samples:
            self.max_value = max(self.max_value, v)
            self.count += 1
            if self.count == num_samples:
                logger.info("Max value for %s: %s", context, self.max_value)
            return False
        return v >= self.max_value * threshold
