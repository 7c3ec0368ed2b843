"""Goodput: where every wall-clock second of a job went, across restarts and relaunches.

A :class:`GoodputLedger` keeps a cursor: at any moment the job is in exactly one
:class:`~stalwart.observability.goodput.records.Bucket`, and every switch closes the previous
interval. Closed intervals are appended to ``<run dir>/goodput.jsonl`` (one ``write`` each, no
fsync on the hot path: a SIGKILL loses at most the open interval, never more than
``flush_interval_s`` of it, plus a torn last line that the reader skips). A session's records
are held back until its first step: a launch refused at start-up (:meth:`GoodputLedger.refused`)
leaves nothing in the file; a start-up killed before its first step leaves no record of its own
(the next session books the gap since the last record as downtime, unless that record ended a
finished job). A new session (a torchrun restart, a relaunch, an in-process attempt) reads the
file first, so it knows:

* the time since the previous session's last record: restart downtime (split into *hang until
  detected* when a watchdog wrote a ``fault`` record with ``cause="hang"``), unless that session
  ended ``finished`` (then it is a new job segment and not counted);
* the highest iteration already completed: iterations up to it are recomputed, *lost work*.

Its own start (launcher start from ``/proc``, or psutil, to the first step) is *startup*, or
*restart* after a fault. Straggler idle time is carved out of productive time with
:meth:`GoodputLedger.add_straggler_idle` (see :func:`straggler_idle_seconds`).

Usage in your own loop (rank 0 writes; every other rank gets the null ledger)::

    >>> import tempfile
    >>> from stalwart.observability.goodput import Bucket, make_goodput_ledger
    >>> run_dir = tempfile.mkdtemp()
    >>> ledger = make_goodput_ledger(True, run_dir, rank=0, print_fn=lambda line: None)
    >>> ledger.resumed(0)                         # after loading (or not) a checkpoint
    >>> for it in range(1, 4):
    ...     with ledger.step(it):                 # productive (lost work if already done)
    ...         pass                              # forward, backward, optimizer step
    ...     if it == 2:
    ...         with ledger.span(Bucket.CHECKPOINT):
    ...             pass                          # the blocking part of a save
    >>> summary = ledger.close("finished")        # prints the goodput line (rank 0)
    >>> sorted(b.value for b, s in summary.seconds.items() if s > 0) != []
    True
    >>> abs(summary.wall_s - (summary.last - summary.first)) < 1e-3
    True

Hot-path cost: two ``time.monotonic()`` calls and a lock per step; a ``write`` per closed interval
(an accepted step writes nothing of its own: its interval runs on into what follows it).
Disabled: :class:`NullGoodputLedger` (same methods, nothing happens).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.observability.goodput.held import HeldIntervals
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import (
    FINISHED,
    GOODPUT_FILE,
    Bucket,
    CompileSource,
    GoodputSummary,
    LedgerFile,
    Marker,
    RecordKind,
    Span,
    add_span,
    empty_seconds,
    goodput_line,
    summarize,
)
from stalwart.observability.goodput.session import (
    anchored_clock,
    high_water_mark,
    launcher_start_time,
    previous_end,
    torchrun_restart_count,
)

if TYPE_CHECKING:  # the ledger itself is standard-library only (the CLI reads it without torch)
    from stalwart.observability.train_log import IntervalInfo, LogField

logger = logging.getLogger(__name__)

DEFAULT_FLUSH_INTERVAL_S = 5.0


def straggler_idle_seconds(compute_ms: Sequence[float], num_iterations: int) -> float:
    """Job seconds the ranks spent waiting on the slowest one over ``num_iterations``.

    Each rank waits ``max - own`` per iteration in the gradient all-reduce; the job-level figure
    is the mean over ranks (rank-seconds / ranks), so it is comparable with wall time.
    """
    if not compute_ms or num_iterations <= 0:
        return 0.0
    slowest = max(compute_ms)
    waits = [max(slowest - c, 0.0) for c in compute_ms]
    return num_iterations * sum(waits) / len(waits) / 1000.0


class StepSpan:
    """Handle of one :meth:`GoodputLedger.step`. ``reclassify`` moves the step's time to another
    bucket (the iteration compiled, or captured a CUDA graph: ``source`` says which); ``abandon``
    too, and the iteration does not count as done (the rerun state machine rejected it)."""

    __slots__ = ("bucket", "completed", "iteration", "source", "started", "started_in")

    def __init__(self, iteration: int, bucket: Bucket, started: float) -> None:
        self.iteration, self.bucket, self.started = iteration, bucket, started
        self.started_in = bucket  # the bucket the step's own time is held under until it ends
        self.completed = True
        self.source: CompileSource | None = None

    def reclassify(self, bucket: Bucket, source: CompileSource | None = None) -> None:
        self.bucket, self.source = bucket, source

    def abandon(self, bucket: Bucket) -> None:
        self.bucket, self.completed, self.source = bucket, False, None


class GoodputLedger:
    """The live ledger of one session (rank 0). See the module docstring.

    Args:
        run_dir: where ``goodput.jsonl`` lives (created if missing).
        flush_interval_s: the longest an open interval stays unwritten (bounds SIGKILL loss).
        launcher_start: wall-clock start of this session; default :func:`launcher_start_time`.
        restart_count: torchrun's restart count; default from ``TORCHELASTIC_RESTART_COUNT``.
        attempt: the in-process restart attempt (0 for the first).
        print_fn: where ``close`` prints the goodput line.
        clock: wall-clock seconds; default ``time.time`` at construction + ``time.monotonic``
            deltas (a stepped system clock cannot create holes or overlaps within a session).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        launcher_start: float | None = None,
        restart_count: int | None = None,
        attempt: int = 0,
        print_fn: Callable[[str], None] = print,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not flush_interval_s > 0:
            raise ValueError(f"goodput flush interval must be > 0 s, got {flush_interval_s}")
        self.path = Path(run_dir) / GOODPUT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self._print = print_fn
        self._clock = clock or anchored_clock()
        self._lock = threading.RLock()
        self._session = f"{socket.gethostname()}-{os.getpid()}-{attempt}-{os.urandom(4).hex()}"
        self._stack: list[tuple[Bucket, CompileSource | None]] = []
        self._source: CompileSource | None = None  # the open interval's (compile spans)
        self._closed = False
        self._last_iteration: int | None = None
        self._idle_pending = 0.0
        self._hang_reported_at: float | None = None
        self._failed: tuple[float, float, Bucket] | None = None
        self._summary: GoodputSummary | None = None
        # The open step's time and the look-ahead's work, held until their bucket is known
        # (a rejected iteration's first pass is not productive).
        self._held = HeldIntervals()
        # Records wait here until the first step (or close): a launch refused at start-up
        # (`refused`) leaves no session in the file and prints no goodput line.
        self._pending: list[bytes] | None = []
        prior = read_ledger(self.path, now=self._clock())
        skipped = prior.skipped_note()
        if skipped:  # once per session; the summary's notes repeat it for `stalwart goodput`
            logger.warning("goodput: %s", skipped)
        self._fd = self._open_append()
        self._totals = dict(summarize(prior).seconds) if prior.records else empty_seconds()
        self._hwm = high_water_mark(prior)
        start = launcher_start if launcher_start is not None else launcher_start_time()
        self._bucket, self._t0 = self._begin(prior, start, restart_count, attempt)

    # ------------------------------------------------------------------ set-up
    def _open_append(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        size = os.fstat(fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")  # end a torn line, so our first record stays readable
        return fd

    def _begin(
        self, prior: LedgerFile, start: float | None, restart_count: int | None, attempt: int
    ) -> tuple[Bucket, float]:
        """Write the session record and the gap since the previous session; returns the bucket
        and start of this session's first interval."""
        now = self._clock()
        start = now if start is None or start > now else start
        last_t, finished, hang_at = previous_end(prior)
        restarts = torchrun_restart_count() if restart_count is None else restart_count
        session: dict[str, Any] = {"launcher_start": round(start, 6), "pid": os.getpid()}
        session.update(host=socket.gethostname(), restart_count=restarts, attempt=attempt)
        session["flush_s"] = self.flush_interval_s
        self._write(Marker(RecordKind.SESSION, now, self._session, session))
        bucket = Bucket.STARTUP
        if last_t is not None:
            if not finished:
                bucket = Bucket.RESTART
                if start > last_t:
                    self._write_gap(last_t, start, hang_at)
            start = max(start, last_t)
        return bucket, start

    def _write_gap(self, last_t: float, start: float, hang_at: float | None) -> None:
        if hang_at is not None and last_t < hang_at < start:
            self._write(Span(Bucket.HANG, last_t, hang_at, self._session, gap=True))
            last_t = hang_at
        self._write(Span(Bucket.RESTART, last_t, start, self._session, gap=True))

    # ------------------------------------------------------------------ writing
    def _write(self, record: Span | Marker) -> None:
        import json

        if isinstance(record, Span):
            add_span(self._totals, record)
        line = (json.dumps(record.to_json(), separators=(",", ":")) + "\n").encode("utf-8")
        if self._pending is not None:
            self._pending.append(line)
            return
        self._append(line)

    def _append(self, data: bytes) -> None:
        try:
            os.write(self._fd, data)
        except OSError as exc:
            # A full disk must not stop training; the reader says what is missing.
            logger.warning("goodput: cannot append to %s: %s", self.path, exc)

    def _commit_session(self) -> None:
        """The session runs: write what it held back since start-up (one write)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending:
                self._append(b"".join(pending))

    def _close_interval(self, now: float, bucket: Bucket | None = None) -> None:
        """Write ``[t0, now]`` of the open interval (as ``bucket`` if given) and reopen at now."""
        self._write_failed()  # a failed step's interval comes first (it ended at t0)
        if now > self._t0:
            b = bucket or self._bucket
            source = self._source if bucket is None else None
            for t0, t1 in self._held.split(b, self._t0, now):  # the rest is held
                self._write_span(b, t0, t1, source)
        self._t0 = max(now, self._t0)

    def _write_span(
        self, bucket: Bucket, t0: float, t1: float, source: CompileSource | None = None
    ) -> None:
        idle = 0.0
        if bucket is Bucket.PRODUCTIVE and self._idle_pending > 0:
            idle = min(self._idle_pending, t1 - t0)
            self._idle_pending -= idle
        span = Span(bucket, t0, t1, self._session, self._last_iteration, idle, source=source)
        self._write(span)

    def _switch(
        self, bucket: Bucket, now: float | None = None, source: CompileSource | None = None
    ) -> None:
        now = self._clock() if now is None else now
        if bucket is not self._bucket or source is not self._source:
            self._close_interval(now)
            self._bucket, self._source = bucket, source
        elif now - self._t0 >= self.flush_interval_s:
            self._flush(now)

    def _flush(self, now: float) -> None:
        """Write the open interval up to the first time still held (a step's own, work run
        ahead): what stays unwritten is a suffix, so a kill leaves no hole in the file."""
        held = self._held.first_held(self._bucket)
        self._close_interval(now if held is None else min(now, max(held, self._t0)))

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def step(self, iteration: int, *, bucket: Bucket | None = None) -> Iterator[StepSpan]:
        """One training iteration (1-based ``iteration``, completed when the block exits).

        Productive, or lost work when a previous session already completed ``iteration``;
        ``bucket`` overrides (e.g. ``Bucket.COMPILE`` for a capture iteration). The time after
        the block until the next switch (logging, the exit decision) stays in the same bucket.
        """
        with self._lock:
            self._commit_session()
            chosen = bucket or (Bucket.LOST_WORK if iteration <= self._hwm else Bucket.PRODUCTIVE)
            now = self._clock()
            self._switch(chosen, now)
            handle = StepSpan(iteration, chosen, now)
            self._held.begin_step(handle)
        try:
            yield handle
        except BaseException:
            with self._lock:
                self._step_failed(handle)
            raise
        with self._lock:
            if handle.bucket is not handle.started_in or handle.source is not None:
                self._close_interval(self._clock())  # reclassified or abandoned
            if handle.completed:
                self._last_iteration = iteration
            self._end_step(handle.bucket, handle.source)
            self._switch(self._bucket, source=self._source)

    def _end_step(self, bucket: Bucket, source: CompileSource | None = None) -> None:
        """Write the step's held intervals as ``bucket`` (and ``source``), its final one
        (``reclassify``, ``abandon``); its nested spans (rerun) are written already. An accepted
        step's open interval stays open: it goes on into what follows the step, as one interval."""
        for t0, t1 in self._held.end_step():
            self._write_span(bucket, t0, t1, source)

    @contextlib.contextmanager
    def ahead(self) -> Iterator[None]:
        """Time the block as part of the *next* :meth:`step`: the look-ahead runs the next
        iteration's first work inside this one. It takes that step's final bucket (a rejected
        iteration's launched first micro-batch is ``rerun``); dropped first (:meth:`drop_ahead`,
        :meth:`close`), it stays with the time around it. Nothing is written here."""
        start = self._clock()
        try:
            yield
        finally:
            with self._lock:
                self._held.ran_ahead(max(start, self._t0), self._clock())

    def drop_ahead(self) -> None:
        """The work timed by :meth:`ahead` was discarded before its step (the look-ahead's
        launch dropped: a rerun, a settle before a save): it stays with the time around it, the
        step that launched it or the loop (a speculative launch's cost, not a failure's)."""
        with self._lock:
            for bucket, t0, t1 in self._held.drop_ahead():
                self._write_span(bucket, t0, t1)

    def _step_failed(self, handle: StepSpan) -> None:
        """The iteration never completed: its time is lost work, or hang until the hang was
        detected when one is reported (before, or right after: an in-process watchdog reports it
        from its abort path). What follows the detection (the escalation: abort, kill, this rank
        seeing its peer gone), until the next first step, is restart downtime."""
        now = self._clock()
        start = max(handle.started, self._t0)
        self._close_interval(start)
        self._end_step(Bucket.LOST_WORK)  # its intervals before the failure: the step failed
        detected = self._hang_detected_since(handle.started)
        split = now if detected is None else min(max(detected, start), now)
        self._failed = (start, split, Bucket.LOST_WORK if detected is None else Bucket.HANG)
        self._bucket, self._t0, self._source = Bucket.RESTART, split, None

    def _hang_detected_since(self, since: float) -> float | None:
        """The first hang detection at or after ``since``: reported to this ledger, or recorded
        in the file by a watchdog (another process; a peer of the hung rank fails when the
        watchdog aborts its process group or kills the hung rank). Failure path only."""
        times = [
            r.t
            for r in read_ledger(self.path, now=self._clock()).records
            if isinstance(r, Marker)
            and r.kind is RecordKind.FAULT
            and r.get("cause") == "hang"
            and r.t >= since
        ]
        if self._hang_reported_at is not None and self._hang_reported_at >= since:
            times.append(self._hang_reported_at)
        return min(times, default=None)

    def _write_failed(self) -> None:
        if self._failed is not None:
            start, end, bucket = self._failed
            self._failed = None
            self._write(Span(bucket, start, end, self._session, self._last_iteration))

    @contextlib.contextmanager
    def span(self, bucket: Bucket, source: CompileSource | None = None) -> Iterator[None]:
        """Time the block as ``bucket`` (evaluation, checkpoint, rerun, compile, ...; a compile
        span's ``source`` says where its time went), then go back to the bucket that was open
        before it. Spans nest."""
        with self._lock:
            self._stack.append((self._bucket, self._source))
            self._switch(bucket, source=source)
        try:
            yield
        finally:
            with self._lock:
                previous, previous_source = self._stack.pop()
                self._switch(previous, source=previous_source)

    def add_straggler_idle(self, seconds: float) -> None:
        """Move ``seconds`` of productive time to the straggler bucket (applied to the next
        productive intervals written; never more than they hold)."""
        if seconds > 0:
            with self._lock:
                self._idle_pending += seconds

    def resumed(self, iteration: int) -> None:
        """Record the checkpoint iteration this session starts from (0: a fresh start)."""
        with self._lock:
            self._write(Marker(RecordKind.RESUME, self._clock(), self._session, {"it": iteration}))

    def rewound(self, through: int) -> None:
        """A spike rewind went back to an older snapshot: iterations up to ``through`` (as
        logged) run again, as lost work."""
        with self._lock:
            self._hwm = max(self._hwm, int(through))

    def fault(self, cause: str, detail: str = "", since: float | None = None) -> None:
        """Record a detected fault (``cause="hang"`` splits the next gap into hang + restart)."""
        fields: dict[str, Any] = {"cause": cause, "detail": detail[:500]}
        if since is not None:
            fields["since"] = since
        with self._lock:
            now = self._clock()
            if cause == "hang":
                self._hang_reported_at = now
                if self._failed is not None:  # reported after the step failed: a hang it was
                    self._failed = (self._failed[0], self._failed[1], Bucket.HANG)
            self._write(Marker(RecordKind.FAULT, now, self._session, fields))

    def summary(self) -> GoodputSummary:
        """The live totals: previous sessions, this one's written intervals and the open one."""
        with self._lock:
            seconds = dict(self._totals)
            if self._failed is not None:
                add_span(seconds, Span(self._failed[2], self._failed[0], self._failed[1], ""))
            step = self._held.step
            held = step.started_in if step is not None else self._bucket
            for t0, t1 in self._held.provisional():  # held: as if the step is accepted
                add_span(seconds, Span(held, t0, t1, ""))
            add_span(seconds, Span(self._bucket, self._t0, max(self._clock(), self._t0), ""))
        return GoodputSummary(seconds, [], [], [])

    @property
    def goodput(self) -> float:
        return self.summary().goodput

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: ``goodput: 97.3%`` on the iteration line, ``goodput`` (percent)
        to TensorBoard/W&B and the metrics file."""
        from stalwart.observability.train_log import LogField

        del info
        with self._lock:  # a log step writes the open interval: a kill loses one interval at most
            if not self._closed:
                self._flush(self._clock())
        return [LogField("goodput", 100.0 * self.goodput, "{:.1f}%", "goodput")]

    def close(self, reason: str = FINISHED, detail: str = "") -> GoodputSummary:
        """End the session: write the open interval and an ``end`` record, print the goodput
        line; returns the summary of the whole file. Idempotent (later calls return it again)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                now = self._clock()
                self._close_interval(now)
                for bucket, t0, t1 in self._held.drop_ahead():  # launched ahead, never used
                    self._write_span(bucket, t0, t1)
                if self._held.step is not None:  # closed from inside a step: it did not end
                    self._end_step(Bucket.LOST_WORK)
                fields = {"reason": reason, "detail": detail[:500], "it": self._last_iteration}
                fields = {k: v for k, v in fields.items() if v not in (None, "")}
                self._write(Marker(RecordKind.END, now, self._session, fields))
                self._commit_session()
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                os.close(self._fd)
                self._summary = summarize(read_ledger(self.path, now=now))
                self._print(goodput_line(self._summary))
        assert self._summary is not None
        return self._summary

    def refused(self) -> GoodputSummary:
        """The launch was refused at start-up (bad input found after the ledger was built: a
        schedule mismatch on resume): before the first step nothing of this session is written
        and no line is printed; after it, the same as ``close("fault")``. Idempotent."""
        with self._lock:
            if self._pending is None or self._closed:
                return self.close("fault", "refused")
            self._closed, self._pending = True, None
            os.close(self._fd)
            self._summary = GoodputSummary(empty_seconds(), [], [], [])
            return self._summary

    def __enter__(self) -> GoodputLedger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: Any
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close("fault", f"{exc_type.__name__}: {exc}")


def record_action(
    run_dir: str | os.PathLike[str],
    action: str,
    detail: str,
    *,
    exit_code: int | None = None,
    world_size: int | None = None,
    devices: Sequence[str] = (),
    when: float | None = None,
) -> None:
    """Append one ``action`` record (what ``stalwart launch`` did after a launch) to
    ``<run_dir>/goodput.jsonl``: one ``write`` of one line, by the launcher, between sessions
    (no session is open then, so the file keeps one writer at a time). A point record: the
    next session still books the time since the previous one as restart downtime."""
    import json
    import time

    fields: dict[str, Any] = {"action": action, "detail": detail[:512]}
    if exit_code is not None:
        fields["exit_code"] = exit_code
    if world_size is not None:
        fields["world_size"] = world_size
    if devices:
        fields["devices"] = ",".join(devices)[:512]
    record = Marker(RecordKind.ACTION, time.time() if when is None else when, "launch", fields)
    path = Path(run_dir) / GOODPUT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        prefix = b""
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                prefix = b"" if f.read(1) == b"\n" else b"\n"  # end a torn line first
        line = json.dumps(record.to_json(), separators=(",", ":")) + "\n"
        os.write(fd, prefix + line.encode("utf-8"))
    finally:
        os.close(fd)


class NullGoodputLedger:
    """Disabled ledger (other ranks, no run directory): same surface, does nothing."""

    _null = contextlib.nullcontext(StepSpan(0, Bucket.PRODUCTIVE, 0.0))

    def step(
        self, iteration: int, *, bucket: Bucket | None = None
    ) -> contextlib.AbstractContextManager[StepSpan]:
        return self._null

    def span(
        self, bucket: Bucket, source: CompileSource | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        return self._null

    def ahead(self) -> contextlib.AbstractContextManager[Any]:
        return self._null

    def drop_ahead(self) -> None: ...
    def add_straggler_idle(self, seconds: float) -> None: ...
    def resumed(self, iteration: int) -> None: ...
    def rewound(self, through: int) -> None: ...
    def fault(self, cause: str, detail: str = "", since: float | None = None) -> None: ...

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        return []

    def close(self, reason: str = FINISHED, detail: str = "") -> None: ...
    def refused(self) -> None: ...

    def __enter__(self) -> NullGoodputLedger:
        return self

    def __exit__(self, *exc: object) -> None: ...


def make_goodput_ledger(
    enabled: bool,
    run_dir: str | os.PathLike[str] | None,
    *,
    rank: int = 0,
    **kwargs: Any,
) -> GoodputLedger | NullGoodputLedger:
    """The ledger on rank 0 with a run directory and ``enabled``; the null ledger otherwise."""
    if not enabled or run_dir is None or rank != 0:
        return NullGoodputLedger()
    return GoodputLedger(run_dir, **kwargs)
