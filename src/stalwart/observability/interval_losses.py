"""The training log's loss sums and iteration counters over one log interval.

Per iteration, :meth:`IntervalLosses.add` keeps a float64 copy of each device loss (one kernel
each: a copy, so a caller may reuse its tensors in place) and the host values; nothing else
touches the device. The log step reads the copies in the training log's one transfer
(:meth:`IntervalLosses.to_read`) and :meth:`IntervalLosses.totals` sums them on the host in
iteration order. Those are float64 additions in the order a device accumulator makes them, so the
sums are bitwise those of one ``acc.add_(value)`` per iteration (IEEE-754 addition on both
sides), and the counters are the same counts.

An interval of more than :data:`MAX_DEFERRED` iterations folds its copies into device
accumulators (the same additions in the same order, on the device; no read), so a long
``--log-interval`` keeps a bounded number of copies; the host sums then start from the folded
sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

TensorOrScalar = torch.Tensor | float | int

MAX_DEFERRED = 256  # iterations kept as copies before they are folded on the device
_ADVANCED, _SKIPPED, _NAN = 0, 1, 2
_COUNT_NAMES = ("advanced", "skipped", "nan")


@dataclass
class _Iteration:
    """One iteration's losses (float64 device copies or host floats) and skip flag."""

    keys: tuple[str, ...]
    values: list[torch.Tensor | float]
    skipped: torch.Tensor | bool  # a bool device copy, or the host flag


class IntervalLosses:
    """Loss sums and the advanced / skipped / NaN counters of the iterations since the last
    :meth:`reset` (see the module docstring). Keys are kept across intervals: the log averages
    every loss it has seen (0 for one absent from an interval)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None  # the first losses' device
        self.skipped_without_pass = 0  # --iterations-to-skip: no loss at all, host only
        self._keys: dict[str, None] = {}
        self._pending: list[_Iteration] = []
        self._sums: dict[str, torch.Tensor] = {}  # folded, float64 on the device
        self._counts: torch.Tensor | None = None  # folded [advanced, skipped, nan], int64

    @property
    def keys(self) -> list[str]:
        """Every loss key seen so far, in order of first sight."""
        return list(self._keys)

    def add(self, losses: Mapping[str, TensorOrScalar], skipped: torch.Tensor | bool) -> None:
        """The completed iteration's losses; ``skipped``: no optimizer step (its losses then
        add nothing, but a non-finite one still counts as a NaN iteration)."""
        if not losses and skipped is True:
            self.skipped_without_pass += 1  # no loss to check; the device is not touched
            return
        if self.device is None:
            tensors = [v for v in losses.values() if isinstance(v, torch.Tensor)]
            self.device = tensors[0].device if tensors else torch.device("cpu")
        device = self.device
        values: list[torch.Tensor | float] = []
        for key, loss in losses.items():
            self._keys.setdefault(key, None)
            if isinstance(loss, torch.Tensor):
                values.append(_copy(loss, device, torch.float64))
            else:
                values.append(float(loss))
        if isinstance(skipped, torch.Tensor):
            skipped = _copy(skipped, device, torch.bool)
        self._pending.append(_Iteration(tuple(losses), values, skipped))
        if len(self._pending) >= MAX_DEFERRED:
            self._fold()

    # ------------------------------------------------------------------------- the log step
    def to_read(self) -> dict[str, torch.Tensor]:
        """Every device value :meth:`totals` needs, by name (for the log's one transfer)."""
        named: dict[str, torch.Tensor] = {}
        if self._counts is not None:
            named.update({f"folded:sum:{k}": v for k, v in self._sums.items()})
            named.update({f"folded:{n}": self._counts[i] for i, n in enumerate(_COUNT_NAMES)})
        for i, it in enumerate(self._pending):
            for j, value in enumerate(it.values):
                if isinstance(value, torch.Tensor):
                    named[f"pending:{i}:{j}"] = value
            if isinstance(it.skipped, torch.Tensor):
                named[f"pending:{i}:skipped"] = it.skipped
        return named

    def totals(self, read: Mapping[str, float | None]) -> dict[str, float]:
        """``sum:<key>`` per key and ``count:advanced|skipped|nan`` of the interval, from the
        values of :meth:`to_read` (as host floats)."""
        sums = {k: _value(read, f"folded:sum:{k}") if k in self._sums else 0.0 for k in self._keys}
        folded = self._counts is not None
        counts = [_value(read, f"folded:{n}") if folded else 0.0 for n in _COUNT_NAMES]
        for i, it in enumerate(self._pending):
            skip = it.skipped
            if not isinstance(skip, bool):
                skip = _value(read, f"pending:{i}:skipped") != 0.0
            counts[_SKIPPED if skip else _ADVANCED] += 1
            values = [
                _value(read, f"pending:{i}:{j}") if isinstance(v, torch.Tensor) else v
                for j, v in enumerate(it.values)
            ]
            if any(not math.isfinite(v) for v in values):
                counts[_NAN] += 1
            for key, value in zip(it.keys, values, strict=True):
                if isinstance(it.skipped, torch.Tensor):
                    sums[key] += 0.0 if skip else value  # torch.where(skip, 0, value)
                elif not skip:
                    sums[key] += value
        out = {f"sum:{k}": v for k, v in sums.items()}
        out.update({f"count:{n}": c for n, c in zip(_COUNT_NAMES, counts, strict=True)})
        return out

    def reset(self) -> None:
        """A new interval (the keys are kept)."""
        self._pending = []
        self._sums, self._counts = {}, None
        self.skipped_without_pass = 0

    # ------------------------------------------------------------------------------- folding
    def _fold(self) -> None:
        """Add the kept copies into the device accumulators, in order (device work only)."""
        for it in self._pending:
            self._fold_one(it)
        self._pending = []

    def _fold_one(self, it: _Iteration) -> None:
        device = self.device
        if self._counts is None:
            self._counts = torch.zeros(3, dtype=torch.int64, device=device)
        counts = self._counts
        skip_t = it.skipped if isinstance(it.skipped, torch.Tensor) else None
        if skip_t is not None:
            counts[_SKIPPED].add_(skip_t.long())
            counts[_ADVANCED].add_((~skip_t).long())
        else:
            counts[_SKIPPED if it.skipped else _ADVANCED].add_(1)
        host_bad = False
        dev_bad: torch.Tensor | None = None
        for key, value in zip(it.keys, it.values, strict=True):
            acc = self._sums.get(key)
            if acc is None:
                acc = self._sums[key] = torch.zeros((), dtype=torch.float64, device=device)
            if isinstance(value, torch.Tensor):
                bad = ~torch.isfinite(value)
                dev_bad = bad if dev_bad is None else dev_bad | bad
            else:
                host_bad |= not math.isfinite(value)
                value = torch.full_like(acc, value)
            if skip_t is not None:
                # torch.where selects, so a NaN loss of a skipped iteration does not leak in.
                acc.add_(torch.where(skip_t, torch.zeros_like(value), value))
            elif not it.skipped:
                acc.add_(value)
        if host_bad:
            counts[_NAN].add_(1)
        elif dev_bad is not None:
            counts[_NAN].add_(dev_bad.long())


def _copy(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d copy of the one-element ``value`` (detached, reshaped only when it needs to be:
    each is a dispatch)."""
    if value.requires_grad:
        value = value.detach()
    if value.dim():
        value = value.reshape(())
    return value.to(device, dtype, copy=True)


def _value(read: Mapping[str, float | None], name: str) -> float:
    value = read[name]
    if value is None:
        raise ValueError(f"IntervalLosses.totals: {name} was not read")
    return value


__all__ = ["MAX_DEFERRED", "IntervalLosses"]
