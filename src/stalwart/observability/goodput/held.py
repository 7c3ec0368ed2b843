"""The parts of the goodput ledger's time whose bucket is known only later.

A step's bucket is known when it ends (an abandoned iteration is ``rerun``, a capture
``compile``), and work the look-ahead runs for the next step inside this one belongs to that next
step. :class:`HeldIntervals` decides, when the ledger closes an interval, which parts of it are
written now and which are held: the open step's own time (from its start, and the look-ahead
work done for it during the previous step) and the look-ahead work done for the next step. Pure
bookkeeping, no I/O: the ledger writes what it returns. While nothing closes (the common case:
an accepted step in the same bucket as the one before) nothing is held and nothing is written.
"""

from __future__ import annotations

from typing import Protocol

from stalwart.observability.goodput.records import Bucket

Interval = tuple[float, float]


class OpenStep(Protocol):
    """What the bookkeeping needs of the ledger's step handle."""

    started: float
    started_in: Bucket


def cut(segments: list[Interval], pieces: list[Interval]) -> tuple[list[Interval], list[Interval]]:
    """``segments`` without ``pieces``, and the parts of ``pieces`` that lay inside them."""
    inside: list[Interval] = []
    for p0, p1 in pieces:
        rest: list[Interval] = []
        for s0, s1 in segments:
            lo, hi = max(s0, p0), min(s1, p1)
            if hi <= lo:
                rest.append((s0, s1))
                continue
            inside.append((lo, hi))
            rest.extend(seg for seg in ((s0, lo), (hi, s1)) if seg[1] > seg[0])
        segments = rest
    return segments, inside


class HeldIntervals:
    """See the module docstring. ``ahead`` pieces are recorded as they end and stay inside the
    open interval until it is closed (they are cut out then, and held)."""

    def __init__(self) -> None:
        self.step: OpenStep | None = None
        self.pieces: list[Interval] = []  # the open step's, cut out of closed intervals
        self._owned_ahead: list[Interval] = []  # run ahead for the open step, not cut out yet
        self._ahead: list[Interval] = []  # run ahead for the next step, not cut out yet
        # Run ahead for the next step, cut out of a closed interval of that bucket.
        self._ahead_held: list[tuple[Bucket, float, float]] = []

    def begin_step(self, step: OpenStep) -> None:
        self.step, self.pieces = step, [(t0, t1) for _, t0, t1 in self._ahead_held]
        self._owned_ahead, self._ahead, self._ahead_held = self._ahead, [], []

    def end_step(self) -> list[Interval]:
        """The step's held intervals, to be written as its final bucket."""
        pieces, self.pieces, self.step, self._owned_ahead = self.pieces, [], None, []
        return pieces

    def ran_ahead(self, t0: float, t1: float) -> None:
        if t1 > t0:
            self._ahead.append((t0, t1))

    def drop_ahead(self) -> list[tuple[Bucket, float, float]]:
        """The look-ahead work for the next step was dropped (a rerun, a settle before a save):
        it belongs to the time it ran in again. Work still inside the open interval stays
        there; work already cut out goes to the open step, else it is returned with the bucket
        it was cut from, to be written so."""
        self._ahead = []
        dropped, self._ahead_held = self._ahead_held, []
        if self.step is not None:
            self.pieces += [(t0, t1) for _, t0, t1 in dropped]
            return []
        return dropped

    def split(self, bucket: Bucket, t0: float, t1: float) -> list[Interval]:
        """Close ``[t0, t1]`` of ``bucket``: returns the parts to write as ``bucket`` now and
        holds the rest (the open step's own time, the next step's look-ahead work)."""
        segments, inside = cut([(t0, t1)], self._ahead)
        self._ahead_held += [(bucket, a0, a1) for a0, a1 in inside]
        self._ahead = [p for p in self._ahead if p[0] >= t1]
        step = self.step
        if step is None:
            return segments
        segments, inside = cut(segments, self._owned_ahead)
        self.pieces += inside
        self._owned_ahead = [p for p in self._owned_ahead if p[0] >= t1]
        if bucket is not step.started_in:
            return segments  # a span nested in the step (rerun): its own bucket
        before, own = cut(segments, [(step.started, max(t1, step.started))])
        self.pieces += own
        return before

    def first_held(self, bucket: Bucket) -> float | None:
        """The earliest time in the open interval (of ``bucket``) that a close would hold."""
        starts = [t0 for t0, _ in (*self._ahead, *self._owned_ahead)]
        if self.step is not None and bucket is self.step.started_in:
            starts.append(self.step.started)
        return min(starts, default=None)

    def provisional(self) -> list[Interval]:
        """Everything held (for the live summary, counted as the open step's bucket)."""
        return [*self.pieces, *((t0, t1) for _, t0, t1 in self._ahead_held)]
