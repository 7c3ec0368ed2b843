"""The per-rank monitor thread of one in-process restart attempt.

While the train function runs, the thread (on its own store connection):

* heartbeats (``hb_<rank>`` counter, every ``heartbeat_interval``) and declares a peer dead when its
  counter has not moved for ``heartbeat_timeout``;
* watches progress (a probe returning the completed iteration): no progress for ``soft_timeout``
  publishes a failure, so every rank restarts; no progress for ``hard_timeout`` kills this
  process (SIGKILL: a rank stuck with the GIL held, or in a collective that never returns, can only
  be recovered by its launcher);
* polls the attempt's ``failure`` key; once any rank has published one, it interrupts the main
  thread: it first calls ``on_failure`` (the wrapper aborts every process group there, so NCCL
  kernels the main thread waits on are cancelled), then raises `RestartRequested` in the main
  thread (``PyThreadState_SetAsyncExc``). That interrupts
  Python code at its next bytecode; a main thread blocked inside a collective returns when the
  failed peer's process group is destroyed (its sockets close) or when the collective times out.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stalwart.reliability.inprocess.policy import FailureKind, FailureRecord
from stalwart.reliability.inprocess.store import RestartStore

logger = logging.getLogger("stalwart.inprocess")

ProgressProbe = Callable[[], int | None]


class RestartRequested(BaseException):
    """Raised in the main thread when another rank failed (a BaseException: ``except Exception``
    in training code must not swallow it)."""


@dataclass(frozen=True)
class MonitorTimes:
    """Seconds; see the module docstring."""

    soft_timeout: float
    hard_timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    poll_interval: float = 0.05


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    arg = ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(None)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), arg)


class AttemptMonitor:
    """Monitor thread of attempt ``attempt``; ``start()`` before, ``leave()`` after the train
    call."""

    def __init__(
        self,
        store: RestartStore,
        attempt: int,
        times: MonitorTimes,
        *,
        main_thread_id: int | None = None,
        on_hard_timeout: Callable[[], None] = _kill_self,
        on_failure: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.attempt, self.times = store, attempt, times
        self.on_failure = on_failure
        self.main_thread_id = main_thread_id or threading.main_thread().ident or 0
        self.on_hard_timeout = on_hard_timeout
        self.clock = clock
        self.probe: ProgressProbe = lambda: None
        # Work that is progress without completing an iteration (a compiled graph: torch's
        # compile counters); None: iterations only.
        self.activity: Callable[[], object] = lambda: None
        self._lock = threading.Lock()
        self._running = False
        self._interrupt_pending = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"stalwart-inprocess-monitor-{attempt}", daemon=True
        )
        self._published = False

    # ------------------------------------------------------------------ main thread
    def start(self) -> None:
        with self._lock:
            self._running = True
        self.reset(self.clock())
        self._thread.start()

    def reset(self, now: float) -> None:
        """Start the clocks of the progress watchdog and the peer heartbeat check at ``now``."""
        self._last_progress, self._progress = now, self._read_progress()
        self._next_beat = now
        self._peer_seen: dict[int, tuple[int, float]] = {}

    def leave(self) -> None:
        """The main thread left the train function: never interrupt it from now on."""
        with self._lock:
            self._running = False
            if self._interrupt_pending:
                _set_async_exc(self.main_thread_id, None)  # drop one not yet delivered
                self._interrupt_pending = False

    def stop(self) -> None:
        self.leave()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def iteration(self) -> int | None:
        """The 1-based iteration running now (None before the first one)."""
        try:
            done = self.probe()
        except Exception:
            return None
        return None if done is None else done + 1

    # ------------------------------------------------------------------ thread
    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.times.poll_interval):
                self.tick(self.clock())
        except Exception as exc:  # a lost store (rank 0 died): the launcher must take over
            logger.error("in-process restart monitor stopped: %s: %s", type(exc).__name__, exc)

    def tick(self, now: float) -> None:
        """One round of checks (the thread calls it every ``poll_interval``)."""
        if now >= self._next_beat:
            self._next_beat = now + self.times.heartbeat_interval
            self.store.beat(self.attempt)
            self._check_peers(now)
        if self.store.failure(self.attempt) is not None:
            self._interrupt_main()
        self._check_progress(now)

    def _read_progress(self) -> object:
        try:
            return self.probe(), self.activity()
        except Exception:
            return None

    def _check_progress(self, now: float) -> None:
        if not self._running:  # finished on this rank, waiting for the others: not a hang
            return
        value = self._read_progress()
        if value != self._progress:
            self._progress, self._last_progress = value, now
            return
        idle = now - self._last_progress
        if idle > self.times.hard_timeout:
            logger.error(
                "in-process restart: rank %d made no progress for %.0fs "
                "(--inprocess-hard-timeout %.0f): killing this process",
                self.store.rank,
                idle,
                self.times.hard_timeout,
            )
            self._stop.set()
            self.on_hard_timeout()
        elif idle > self.times.soft_timeout:
            self._publish(
                FailureKind.WATCHDOG,
                "NoProgress",
                f"no progress for {idle:.0f}s (--inprocess-soft-timeout "
                f"{self.times.soft_timeout:g})",
            )

    def _check_peers(self, now: float) -> None:
        beats = self.store.peer_beats(self.attempt)
        for rank, count in enumerate(beats):
            if rank == self.store.rank:
                continue
            seen = self._peer_seen.get(rank)
            if seen is None or seen[0] != count:
                self._peer_seen[rank] = (count, now)
            elif now - seen[1] > self.times.heartbeat_timeout:
                self._publish(
                    FailureKind.DEAD_RANK,
                    "RankDead",
                    f"rank {rank} sent no heartbeat for {now - seen[1]:.0f}s",
                    rank=rank,
                )

    def _publish(self, kind: FailureKind, error_type: str, message: str, rank: int = -1) -> None:
        if self._published:
            return
        self._published = True
        record = FailureRecord(
            attempt=self.attempt,
            rank=self.store.rank if rank < 0 else rank,
            kind=kind,
            error_type=error_type,
            message=message,
            iteration=self.iteration(),
            host=socket.gethostname(),
        )
        self.store.publish_failure(record)

    def _interrupt_main(self) -> None:
        with self._lock:
            if self._running and not self._interrupt_pending:
                self._interrupt_pending = True
                try:  # abort first: NCCL kernels the main thread may be waiting on must end
                    self.on_failure()
                except Exception as exc:
                    logger.warning("in-process restart: abort from the monitor failed: %s", exc)
                _set_async_exc(self.main_thread_id, RestartRequested)
