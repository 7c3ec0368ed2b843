"""Validation records and the graph-safe :class:`ValidationBuffer`.

A validation call never reads a device value. It records a scalar (device tensor or host float)
with its check specification; the state machine reads all recorded values of an iteration in one
deliberate sync and evaluates the checks on host floats.

Rejection and comparison functions are called with host values. ``torch.isnan`` / ``torch.isinf``
are evaluated with :mod:`math`; callables marked with :func:`host_predicate` (such as
``RerunStateMachine.is_unexpectedly_large`` and ``compare_floats``) receive Python floats; any other
callable receives 0-d CPU float64 tensors (Megatron compatibility), never device tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from stalwart.reliability.rerun.stats import compare_floats
from stalwart.reliability.rerun.types import CallKey

F = TypeVar("F", bound=Callable[..., Any])


def host_predicate(func: F) -> F:
    """Mark a rejection or comparison function as taking Python floats instead of tensors."""
    func.accepts_host_float = True  # type: ignore[attr-defined]
    return func


host_predicate(compare_floats)


def _accepts_host(func: Callable[..., Any]) -> bool:
    if getattr(func, "accepts_host_float", False):
        return True
    inner = func.func if isinstance(func, functools.partial) else None
    return bool(inner is not None and getattr(inner, "accepts_host_float", False))


def evaluate_rejection(func: Callable[..., Any] | None, value: float) -> bool:
    """Apply a rejection function to a host value (never touches a device)."""
    if func is None:
        return False
    if func is torch.isnan:
        return math.isnan(value)
    if func is torch.isinf:
        return math.isinf(value)
    if _accepts_host(func):
        return bool(func(value))
    return bool(func(torch.tensor(value, dtype=torch.float64)))


def evaluate_comparison(func: Callable[..., Any], initial: float, rerun: float) -> float:
    """Apply a comparison function to two host values; NaN is treated as a mismatch."""
    if _accepts_host(func):
        out = float(func(initial, rerun))
    else:
        t = functools.partial(torch.tensor, dtype=torch.float64)
        out = float(func(t(initial), t(rerun)))
    return math.inf if math.isnan(out) else out


@dataclass(frozen=True)
class CheckSpec:
    """What a validation call checks and how a rerun is compared with the initial run."""

    message: str
    rejection_func: Callable[..., Any] | None
    comparison_func: Callable[..., Any] = compare_floats
    tolerance: float = 0.0
    fatal: bool = True


@dataclass
class ValidationRecord:
    """One validation call of the current run, before its value is read."""

    key: CallKey
    spec: CheckSpec
    value: torch.Tensor | float
    injected: bool = False


def as_scalar(result: torch.Tensor | float) -> torch.Tensor | float:
    """Detached float64 0-d copy of a one-element tensor (device op only), or a Python float."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ValueError(f"validation results must be scalars; got shape {tuple(result.shape)}")
        return result.detach().reshape(()).to(torch.float64, copy=True)
    return float(result)


class ValidationBuffer:
    """Static device buffer for checks that run inside a captured CUDA graph.

    Declare the checks before capture with :meth:`add_check` (one slot per call site and
    micro-batch), then call :meth:`record` from the captured code: it only performs device ops on
    preallocated tensors (no allocation visible to the host, no sync), so the graph writes its
    values on every replay. Attach the buffer with ``RerunStateMachine.attach_buffer``; the machine
    clears it before each run, sets the error-injection mask, and reads it in its one per-iteration
    sync together with the eager checks.
    """

    def __init__(self, device: torch.device | str, name: str = "graph", capacity: int = 64) -> None:
        self.name = name
        self.device = torch.device(device)
        self.values = torch.zeros(capacity, dtype=torch.float64, device=self.device)
        self.written = torch.zeros(capacity, dtype=torch.float64, device=self.device)
        self.inject = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.specs: list[CheckSpec] = []
        self.keys: list[CallKey] = []
        self.inject_host: list[bool] = []
        # Speculative launch support: values read ahead, and a pass already begun.
        self._snapshot: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._begun_ahead = False
        self._pinned: torch.Tensor | None = None
        self._pinned_event: torch.cuda.Event | None = None

    def add_check(
        self,
        message: str,
        rejection_func: Callable[..., Any] | None,
        *,
        comparison_func: Callable[..., Any] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> int:
        """Reserve a slot; returns its index for :meth:`record`. Not graph-safe: call before capture."""
        if len(self.specs) >= self.values.numel():
            raise ValueError(
                f"ValidationBuffer {self.name!r} is full ({self.values.numel()} slots)"
            )
        spec = CheckSpec(
            message, rejection_func, comparison_func or compare_floats, tolerance, fatal
        )
        seq = 1 + sum(1 for s in self.specs if s.message == message)
        self.specs.append(spec)
        self.keys.append((self.name, message, seq))
        self.inject_host.append(False)
        return len(self.specs) - 1

    def record(self, slot: int, value: torch.Tensor) -> None:
        """Write a one-element tensor into ``slot`` (device ops only; safe inside capture)."""
        v = value.detach().reshape(()).to(torch.float64)
        v = torch.where(self.inject[slot], math.nan, v)
        self.values[slot].copy_(v)
        self.written[slot].fill_(1.0)

    def begin(self, inject_mask: list[bool]) -> None:
        """Machine hook before a run: clear the written flags; upload the mask only on change.

        After :meth:`begin_ahead` with the same mask the pass has begun already (its writes may
        have landed): nothing is cleared then.
        """
        if self._begun_ahead and inject_mask == self.inject_host:
            self._begun_ahead = False
            return
        self._begun_ahead = False
        self.written.zero_()
        if inject_mask != self.inject_host:
            self.inject[: len(inject_mask)].copy_(torch.tensor(inject_mask, dtype=torch.bool))
            self.inject_host = list(inject_mask)

    def snapshot(self) -> None:
        """Freeze this pass's values for the machine's next read, without waiting.

        For a speculative launch of the next forward-backward before this pass is read: the
        values are copied (stream-ordered, to pinned memory on CUDA) and the next read uses the
        copy, so the next pass may overwrite the buffer meanwhile.
        """
        n = len(self.specs)
        flat = torch.cat([self.values[:n], self.written[:n]])
        if not flat.is_cuda:
            self._snapshot = (flat.clone(), None)
            return
        # One pinned buffer and event, reused: the previous snapshot was read before this one.
        if self._pinned is None or self._pinned.shape != flat.shape:
            self._pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._pinned_event = torch.cuda.Event()
        self._pinned.copy_(flat, non_blocking=True)
        assert self._pinned_event is not None
        self._pinned_event.record()
        self._snapshot = (self._pinned, self._pinned_event)

    def begin_ahead(self) -> None:
        """Begin the next pass now (clear written flags, device work only), for a launch that
        precedes the machine's own :meth:`begin`; the injection mask stays as it is."""
        self.written.zero_()
        self._begun_ahead = True

    def take_snapshot(self) -> list[float] | None:
        """Host values then written flags of the last :meth:`snapshot` (consumed), or None."""
        if self._snapshot is None:
            return None
        host, event = self._snapshot
        self._snapshot = None
        if event is not None:
            event.synchronize()  # deliberate: waits only for the copy, not for later work
        return host.tolist()


def read_values(
    records: list[ValidationRecord], buffers: list[ValidationBuffer]
) -> list[tuple[ValidationRecord, float]]:
    """Host values of every eager record and every written buffer slot, in one read.

    All device scalars are concatenated on the first one's device and copied to the host once.
    """
    parts: list[torch.Tensor] = [r.value for r in records if isinstance(r.value, torch.Tensor)]
    used = [b for b in buffers if b.specs]
    snapshots = {id(b): b.take_snapshot() for b in used}
    for b in used:
        n = len(b.specs)
        if snapshots[id(b)] is None:
            parts += [b.values[:n], b.written[:n]]
    host: list[float] = []
    if parts:
        device = parts[0].device
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        # Deliberate sync: the one per-iteration read of every validation value.
        host = flat.tolist()
    pos = 0
    items: list[tuple[ValidationRecord, float]] = []
    for r in records:
        if isinstance(r.value, torch.Tensor):
            items.append((r, host[pos]))
            pos += 1
        else:
            items.append((r, r.value))
    for b in used:
        n = len(b.specs)
        snapshot = snapshots[id(b)]
        if snapshot is not None:
            vals, written = snapshot[:n], snapshot[n:]
        else:
            vals, written = host[pos : pos + n], host[pos + n : pos + 2 * n]
            pos += 2 * n
        for i in range(n):
            if written[i] > 0.5:
                rec = ValidationRecord(b.keys[i], b.specs[i], vals[i], b.inject_host[i])
                items.append((rec, vals[i]))
    return items
