"""Blending several token sources by weight (``--data-path 0.3 a.bin 0.7 b.bin``, Megatron's
syntax).

``--data-path`` takes one path, several paths (equal weights), or ``weight path`` pairs. Each
source is split into train/valid on its own (the same ``--valid-fraction``), then the splits are
blended: `BlendedDataset` interleaves its sources so that every prefix of the blend holds each
source in proportion to its weight (within one sample), smaller sources repeating (upsampled)
and larger ones truncated to their share of the blend's length. The index is a pure function of
the sources' lengths and weights, so the blend, like a single source, is resumable: the sampler
only stores how many samples were consumed. In a hand-written loop::

    a, b = TokenDataset(load_tokens("a.bin"), 1024), TokenDataset(load_tokens("b.bin"), 1024)
    sampler = MicroBatchIterator(BlendedDataset([a, b], [0.3, 0.7]), mbs, dp_rank, dp_size, seed=1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class SampleSource(Protocol):
    """What the samplers read: a length and ``seq_length + 1`` tokens per sample."""

    def __len__(self) -> int: ...
    def window(self, index: int) -> np.ndarray: ...


def _as_weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_blend(value: str | Sequence[str] | None) -> list[tuple[float, str]] | None:
    """``--data-path`` -> ``[(weight, path), ...]`` with weights summing to 1; None: the corpus.

    Accepts one path, several paths (equal weights) or ``w1 p1 w2 p2 ...``. ``ValueError`` naming
    ``--data-path`` for a mix of the two forms, a missing path, or a weight that is not a finite
    number > 0.
    """
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError("--data-path needs at least one path")
    weights = [_as_weight(x) for x in items[0::2]]
    if len(items) >= 2 and all(w is not None for w in weights):
        if len(items) % 2:
            raise ValueError(
                f"--data-path: weights and paths must come in pairs (w1 p1 w2 p2 ...), got {items}"
            )
        pairs = [(float(w), p) for w, p in zip(items[0::2], items[1::2], strict=True)]
    else:
        pairs = [(1.0, p) for p in items]
    for weight, path in pairs:
        if _as_weight(path) is not None:
            raise ValueError(f"--data-path: expected a path, got the number {path!r} ({items})")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"--data-path: weights must be finite numbers > 0, got {weight} for {path!r}"
            )
    total = sum(w for w, _ in pairs)
    if not math.isfinite(total):
        raise ValueError(f"--data-path: the weights' sum overflows ({items}); scale them down")
    return [(w / total, p) for w, p in pairs]


class BlendedDataset:
    """Samples of several sources interleaved by weight; see the module docstring.

    Length: the sum of the sources' lengths (one pass over the blend sees about as many samples
    as the sources hold together). Sample ``i`` of the blend is sample ``j`` of source ``d`` with
    ``(d, j)`` from a precomputed index (9 bytes per sample).
    """

    def __init__(self, sources: Sequence[SampleSource], weights: Sequence[float]) -> None:
        if not sources or len(sources) != len(weights):
            raise ValueError("BlendedDataset needs one weight per source (at least one source)")
        if any(len(s) < 1 for s in sources):
            raise ValueError("--data-path: a source has no sample (too short for --seq-length)")
        self.sources = list(sources)
        total_weight = float(sum(weights))
        self.weights = [float(w) / total_weight for w in weights]
        self._len = sum(len(s) for s in sources)
        counts = self._shares(self._len)
        # Sample k of source d is due at "time" (k + 0.5) / count_d; sorting all due times
        # interleaves the sources evenly (a stable sort breaks ties by source order).
        due = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
        source_ids = np.concatenate([np.full(n, d, dtype=np.int8) for d, n in enumerate(counts)])
        sample_ids = np.concatenate(
            [np.arange(n, dtype=np.int64) % len(s) for n, s in zip(counts, sources, strict=True)]
        )
        order = np.argsort(due, kind="stable")
        self._source_ids = source_ids[order]
        self._sample_ids = sample_ids[order]

    def _shares(self, total: int) -> list[int]:
        """Samples per source, proportional to the weights, summing to ``total``, each >= 1."""
        raw = [w * total for w in self.weights]
        counts = [max(1, int(r)) for r in raw]
        # Hand out what rounding down left over, largest remainders first (deterministic).
        for d in sorted(range(len(raw)), key=lambda d: (counts[d] - raw[d], d)):
            if sum(counts) >= total:
                break
            counts[d] += 1
        while sum(counts) > total:  # only when many tiny weights were raised to 1
            d = max(range(len(counts)), key=lambda d: (counts[d], -d))
            counts[d] -= 1
        return counts

    def __len__(self) -> int:
        return self._len

    @property
    def identity(self) -> list[list[float]]:
        """``[[weight, source length], ...]``: what fixes the sample order besides the seed.

        The sampler stores it in checkpoints and refuses to resume under another blend (other
        weights or sources of other lengths), which the total length alone would not reveal.
        """
        return [[round(w, 12), float(len(s))] for w, s in zip(self.weights, self.sources)]

    def source_of(self, index: int) -> int:
        """Which source sample ``index`` comes from."""
        return int(self._source_ids[index])

    def window(self, index: int) -> np.ndarray:
        if not 0 <= index < self._len:
            raise IndexError(f"sample index {index} out of range [0, {self._len})")
        source = self.sources[int(self._source_ids[index])]
        return source.window(int(self._sample_ids[index]))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.window(index))
        return w[:-1], w[1:]
