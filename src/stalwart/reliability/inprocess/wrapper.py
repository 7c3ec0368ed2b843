"""In-process restart: re-run a train function in the same processes after a fault.

Cycle of one failed attempt, on every rank::

    fault (a rank raises, the watchdog fires, a peer stops heartbeating)
      -> the first rank to see it publishes a FailureRecord in the store; every other rank's
         monitor thread sees the record and interrupts its main thread
      -> abort:    callbacks registered by the train function (async checkpoint: discard the
                   in-flight save, no collectives), then abort every process group
      -> finalize: callbacks (close the trainer), drop every reference to the attempt (its frames
                   via the traceback too), gc, empty the CUDA cache, malloc_trim; measure memory
      -> decide:   every rank reads the same records and applies `decide_retry` (attempt limit,
                   same fault twice) -> give up with EXIT_CODE_INPROCESS_GAVE_UP
      -> health:   the device still computes correctly (configurable checks)
      -> rendezvous on attempt n+1's fresh store namespace, new process group (with a forced
         first collective), call the train function again: it rebuilds everything from the
         config and resumes from the newest complete checkpoint.

What must outlive the attempts (a compile cache: `stalwart.compile.CompileCache`) is created by
the caller outside :meth:`InProcessRestarter.run` and passed into the train function, never kept
in module state; everything else is rebuilt by each attempt.

On gloo, aborting a process group does not interrupt a collective already waiting in it; the
collective returns when the peer's sockets close, which happens when the failing rank's finalize
drops its last reference to its group. A rank whose failure leaves it blocked forever (a peer hung
with the GIL held) is killed by its own hard timeout, and the launcher restarts the job. Nothing
may keep a failed attempt's group alive past its finalize: see the import of
``torch.distributed.nn`` in `stalwart.distributed.process_group` (imported before any group).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from stalwart.distributed.launch_env import env_int
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.inprocess.config import InProcessConfig, RestartGranularity
from stalwart.reliability.inprocess.health import (
    HealthCheck,
    MemorySample,
    check_device_computes,
    release_memory,
    run_health_checks,
    sample_memory,
)
from stalwart.reliability.inprocess.monitor import (
    AttemptMonitor,
    MonitorTimes,
    ProgressProbe,
    RestartRequested,
)
from stalwart.reliability.inprocess.policy import (
    EXIT_CODE_INPROCESS_GAVE_UP,
    EXIT_CODE_UNHEALTHY,
    FailureKind,
    FailureRecord,
    Verdict,
    decide_retry,
    short_message,
    verdict_message,
)
from stalwart.reliability.inprocess.store import RestartStore, StoreAddress

logger = logging.getLogger("stalwart.inprocess")

T = TypeVar("T")
GroupFactory = Callable[[dist.Store], DistributedContext]

_COMM_ERROR_HINTS = ("connection closed", "connection reset", "broken pipe", "aborted", "timed out")


class InProcessRestartExhausted(RuntimeError):
    """In-process restart gave up; ``exit_code`` is what the process should exit with."""

    def __init__(self, message: str, verdict: Verdict, exit_code: int) -> None:
        super().__init__(message)
        self.verdict, self.exit_code = verdict, exit_code


@dataclass(frozen=True)
class RestartOptions:
    """Knobs of :class:`InProcessRestarter` (seconds; see ``InProcessConfig`` for the flags)."""

    max_iterations: int = 3
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float | None = None  # default: soft_timeout
    granularity: RestartGranularity = RestartGranularity.RANK
    barrier_timeout: float = 300.0
    health_checks: tuple[HealthCheck, ...] = (check_device_computes,)
    health_timeout: float = 30.0
    poll_interval: float = 0.05  # the monitor thread's checks (--inprocess-monitor-thread-interval)
    no_retry: tuple[type[BaseException], ...] = ()

    @classmethod
    def from_config(cls, config: InProcessConfig, **overrides: Any) -> RestartOptions:
        values: dict[str, Any] = {
            "max_iterations": config.inprocess_max_iterations,
            "soft_timeout": config.inprocess_soft_timeout,
            "hard_timeout": config.inprocess_hard_timeout,
            "heartbeat_interval": config.inprocess_heartbeat_interval,
            "heartbeat_timeout": config.inprocess_heartbeat_timeout,
            "barrier_timeout": config.inprocess_barrier_timeout,
            "poll_interval": config.inprocess_monitor_thread_interval,
            "granularity": RestartGranularity(config.inprocess_granularity),
        }
        return cls(**{**values, **overrides})

    def monitor_times(self) -> MonitorTimes:
        return MonitorTimes(
            soft_timeout=self.soft_timeout,
            hard_timeout=self.hard_timeout,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout or self.soft_timeout,
            poll_interval=self.poll_interval,
        )


@dataclass
class Attempt:
    """What the train function gets: where it runs, and hooks for abort/finalize/progress.

    The train function must build all its state from scratch (nothing global), register how to
    abort it without collectives (``on_abort``) and how to release it (``on_finalize``), and give a
    progress probe (completed iterations) for the watchdog.
    """

    index: int
    ctx: DistributedContext
    store: dist.Store
    monitor: AttemptMonitor
    abort_callbacks: list[Callable[[], object]] = field(default_factory=list)
    finalize_callbacks: list[Callable[[], object]] = field(default_factory=list)
    # Run right before any process-group abort, by whichever thread aborts (main or monitor).
    pre_abort_callbacks: list[Callable[[], object]] = field(default_factory=list)

    def on_abort(self, fn: Callable[[], object]) -> None:
        self.abort_callbacks.append(fn)

    def before_process_group_abort(self, fn: Callable[[], object]) -> None:
        """Release what keeps a communicator alive (idempotent, thread-safe, no collectives).

        CUDA graphs that captured NCCL collectives hold references on the communicator, and
        aborting it waits for them: drop such graphs here or the abort never returns.
        """
        self.pre_abort_callbacks.append(fn)

    def on_finalize(self, fn: Callable[[], object]) -> None:
        self.finalize_callbacks.append(fn)

    def set_progress(
        self, probe: ProgressProbe, activity: Callable[[], object] | None = None
    ) -> None:
        """``probe``: completed iterations. ``activity``: a value that changes with other work
        that is progress (torch's compile counters: a cold compile of a model's graphs can take
        longer than the soft timeout, one graph at a time); the watchdog fires when neither
        changed for the soft timeout."""
        self.monitor.probe = probe
        if activity is not None:
            self.monitor.activity = activity


@dataclass
class _Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_ERROR_HINTS)


def quiesce_workers(seconds: float = 0.05) -> None:
    """Release the GIL briefly so gloo worker threads finish destroying completed work items.

    A gloo work item whose tensors have Python objects takes the GIL in its destructor, on the
    worker thread; destroying the process group joins that thread while the caller holds the GIL.
    Without a pause between the last collective and the destruction the two can deadlock.
    """
    time.sleep(seconds)


@contextlib.contextmanager
def _deadlock_guard(timeout_s: float) -> Iterator[None]:
    """Exit the process (code 1, after dumping every thread's stack) if the block takes longer
    than ``timeout_s``: faulthandler's watchdog is a C thread that needs no GIL, so it also ends
    a deadlock inside a process-group destructor; the launcher then restarts the job."""
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _call_each(callbacks: Iterable[Callable[[], object]]) -> None:
    """Call each (errors ignored); keeps no reference to any once it returns."""
    for callback in callbacks:
        with contextlib.suppress(Exception):
            callback()


def release_then_abort(pre_abort: list[Callable[[], object]]) -> None:
    """Run the pre-abort callbacks (newest first, errors ignored), then abort every group."""
    for callback in reversed(list(pre_abort)):
        with contextlib.suppress(Exception):
            callback()
    abort_process_groups()


def abort_process_groups() -> None:
    """Abort every process group (NCCL: kills pending kernels; gloo: unregisters them)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
            return
        dist.destroy_process_group()


class InProcessRestarter:
    """Runs ``fn(attempt)`` until it returns, restarting it in-process after faults.

    Collective over the job: every rank constructs one (rank 0 hosts the store) and calls
    :meth:`run`. ``init_group(store)`` must create the default process group from ``store`` and
    run one collective (so the backend is fully initialised before anything can abort it).
    """

    def __init__(
        self,
        options: RestartOptions,
        init_group: GroupFactory,
        *,
        store: RestartStore | None = None,
        device: torch.device | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.options = options
        self.init_group = init_group
        rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1, minimum=1)
        self.store = store or RestartStore(
            StoreAddress.from_env(), rank, world, timeout_s=options.barrier_timeout
        )
        self.rank, self.world_size = self.store.rank, self.store.world_size
        self.device = device or torch.device("cpu")
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.memory: list[MemorySample] = []  # after each failed attempt's finalize
        self.failures: list[FailureRecord] = []
        self._phases: dict[str, float] = {}  # monotonic times of the current recovery's phases

    # ------------------------------------------------------------------ the loop
    def run(self, fn: Callable[[Attempt], T]) -> T:
        n = self.store.current_attempt()
        while True:
            attempt = self._start(n)
            outcome = self._call(fn, attempt)
            if outcome.error is None and self._completed(attempt):
                attempt.monitor.stop()
                with _deadlock_guard(self.options.hard_timeout), contextlib.suppress(Exception):
                    quiesce_workers()
                    dist.destroy_process_group()
                self._leave(n)
                return outcome.value  # type: ignore[return-value]
            self._phases = {"detected": time.monotonic()}
            record = self._record(attempt, outcome.error)
            fatal = outcome.error if record.kind is FailureKind.FATAL else None
            del outcome
            self._abort_and_finalize(attempt, record)
            self._phases["finalized"] = time.monotonic()
            del attempt
            self._decide(n, fatal)
            n += 1
            self._health(n)
            self._phases["healthy"] = time.monotonic()

    def _start(self, n: int) -> Attempt:
        self.store.advance_attempt(n)
        self.store.barrier(n, "rendezvous", self.options.barrier_timeout)
        ctx = self.init_group(self.store.group_store(n))
        pre_abort: list[Callable[[], object]] = []  # filled by the train function
        monitor = AttemptMonitor(
            self.store.client(),
            n,
            self.options.monitor_times(),
            on_failure=functools.partial(release_then_abort, pre_abort),
        )
        monitor.start()
        if n and self.rank == 0:
            self.say(
                f"in-process restart attempt {n}: process group rebuilt, training resumes "
                f"({self._timing()})"
            )
        return Attempt(
            index=n,
            ctx=ctx,
            store=self.store.attempt(n),
            monitor=monitor,
            pre_abort_callbacks=pre_abort,
        )

    def _timing(self) -> str:
        p, now = self._phases, time.monotonic()
        if not {"detected", "finalized", "healthy"} <= p.keys():
            return "timing unavailable"
        return (
            f"abort+finalize {p['finalized'] - p['detected']:.2f}s, "
            f"decide+health {p['healthy'] - p['finalized']:.2f}s, "
            f"rendezvous+process group {now - p['healthy']:.2f}s"
        )

    def _call(self, fn: Callable[[Attempt], T], attempt: Attempt) -> _Outcome[T]:
        """Run ``fn``; an interrupt from the monitor that arrives late still counts as a fault."""
        outcome: _Outcome[T] | None = None
        while True:
            try:
                if outcome is None:
                    outcome = self._invoke(fn, attempt)
                attempt.monitor.leave()
                return outcome
            except RestartRequested as late:
                if outcome is None or outcome.error is None:
                    outcome = _Outcome(error=late)

    @staticmethod
    def _invoke(fn: Callable[[Attempt], T], attempt: Attempt) -> _Outcome[T]:
        try:
            return _Outcome(value=fn(attempt))
        except BaseException as exc:  # every fault, interrupts included, goes to recovery
            return _Outcome(error=exc)

    def _completed(self, attempt: Attempt) -> bool:
        """Success on this rank: wait until every rank succeeded (True) or one failed (False)."""
        n = attempt.index
        self.store.set_rank_value(n, "done", "1")
        while True:
            if self.store.failure(n) is not None:
                return False
            if all(v is not None for v in self.store.rank_values(n, "done")):
                return True
            time.sleep(0.05)

    def _leave(self, n: int) -> None:
        """Rank 0 hosts the store: it returns only after every other rank stopped using it."""
        left = int(self.store.attempt(n).add("left", 1))
        deadline = time.monotonic() + self.options.barrier_timeout
        while self.rank == 0 and left < self.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            left = int(self.store.attempt(n).add("left", 0))

    # ------------------------------------------------------------------ recovery
    def _record(self, attempt: Attempt, exc: BaseException | None) -> FailureRecord:
        """The failure of this attempt that every rank agrees on (first published wins)."""
        n = attempt.index
        if exc is None or isinstance(exc, RestartRequested):
            found = self.store.wait_failure(n, timeout_s=5.0)
            if found is not None:
                return found
        elif _is_comm_error(exc):
            grace = 2 * self.options.heartbeat_interval + 1.0
            found = self.store.wait_failure(n, timeout_s=grace)
            if found is not None:
                return found
        if exc is None:
            exc = RuntimeError("a peer failed while this rank completed")
        if isinstance(exc, tuple(self.options.no_retry)) or not isinstance(exc, Exception):
            kind = FailureKind.FATAL
        elif _is_comm_error(exc) or isinstance(exc, RestartRequested):
            kind = FailureKind.COMMUNICATION
        else:
            kind = FailureKind.EXCEPTION
        mine = FailureRecord(
            attempt=n,
            rank=self.rank,
            kind=kind,
            error_type=type(exc).__name__,
            message=short_message(exc),
            iteration=attempt.monitor.iteration(),
            host=socket.gethostname(),
        )
        winner = self.store.publish_failure(mine)  # first, so peers stop waiting on us early
        if kind is not FailureKind.COMMUNICATION:
            logger.error("rank %d failed: %s", self.rank, "".join(traceback.format_exception(exc)))
        return winner

    def _abort_and_finalize(self, attempt: Attempt, record: FailureRecord) -> None:
        n = attempt.index
        if self.rank == 0:
            where = "?" if record.iteration is None else str(record.iteration)
            self.say(
                f"in-process restart attempt {n + 1}: rank {record.rank} failed at iteration "
                f"{where}: {record.cause()} ({record.kind.value})"
            )
        attempt.monitor.stop()
        _call_each(reversed(attempt.abort_callbacks))
        release_then_abort(attempt.pre_abort_callbacks)
        if record.rank != self.rank:
            # Our pending collectives wait on the failed rank; they end when its groups are freed.
            # Freeing ours before that could join a gloo worker still blocked in one of them.
            self.store.wait_rank_value(n, "released", record.rank, self._release_wait_s())
        with _deadlock_guard(self.options.hard_timeout):
            quiesce_workers()
            # In a function of its own: a loop variable here would keep the last callback's
            # object (its process groups) alive through the gc.collect() below.
            _call_each(reversed(attempt.finalize_callbacks))
            attempt.abort_callbacks.clear()
            attempt.finalize_callbacks.clear()
            attempt.pre_abort_callbacks.clear()
            attempt.monitor.probe = attempt.monitor.activity = lambda: None
            release_memory(self.device)  # gc.collect(): the attempt's groups are destroyed here
        self.store.set_rank_value(n, "released", "1")
        sample = sample_memory(self.device)
        self.memory.append(sample)
        after = f"rank {self.rank} after finalize: {sample.describe()}"
        msg = f"in-process restart attempt {n + 1}: {after}"
        if self.rank == 0:
            self.say(msg)
        else:
            logger.info(msg)

    def _release_wait_s(self) -> float:
        return 2 * self.options.heartbeat_interval + 5.0

    def _decide(self, n: int, fatal: BaseException | None) -> None:
        history = self.store.history(n)
        self.failures = history
        verdict = decide_retry(history, self.options.max_iterations)
        if verdict is Verdict.RETRY:
            return
        message = verdict_message(verdict, history, self.options.max_iterations)
        if self.rank == 0:
            self.say(message)
        if fatal is not None:
            raise fatal
        raise InProcessRestartExhausted(message, verdict, EXIT_CODE_INPROCESS_GAVE_UP)

    def _health(self, n: int) -> None:
        """Check this rank's device; unhealthy ranks (their whole node with granularity ``node``)
        leave with EXIT_CODE_UNHEALTHY so that their launcher replaces them."""
        problem = run_health_checks(
            self.options.health_checks, self.device, self.options.health_timeout
        )
        host = socket.gethostname()
        self.store.set_rank_value(n, "health", f"{'ok' if problem is None else 'bad'} {host}")
        if problem is not None:
            self.say(f"in-process restart: rank {self.rank} failed its health check: {problem}")
            raise InProcessRestartExhausted(problem, Verdict.STOP_FATAL, EXIT_CODE_UNHEALTHY)
        if self.options.granularity is not RestartGranularity.NODE:
            return
        bad = unhealthy_peers(self._wait_health(n))
        if host in bad.values():
            raise InProcessRestartExhausted(
                f"in-process restart: node {host} leaves: ranks {sorted(bad)} on it are unhealthy",
                Verdict.STOP_FATAL,
                EXIT_CODE_UNHEALTHY,
            )

    def _wait_health(self, n: int) -> list[str | None]:
        """Every rank's health value (None for a rank that did not report in time: dead)."""
        deadline = time.monotonic() + self.options.health_timeout + 5.0
        while True:
            values = self.store.rank_values(n, "health")
            if all(v is not None for v in values) or time.monotonic() >= deadline:
                return values
            time.sleep(0.05)


def unhealthy_peers(values: Sequence[str | None]) -> dict[int, str]:
    """``{rank: host}`` of ranks whose published health value says ``bad``."""
    bad: dict[int, str] = {}
    for rank, value in enumerate(values):
        if value is not None and value.startswith("bad"):
            bad[rank] = value.split(" ", 1)[1] if " " in value else ""
    return bad


def restartable(
    fn: Callable[[Attempt], T],
    options: RestartOptions,
    init_group: GroupFactory,
    **kwargs: Any,
) -> Callable[[], T]:
    """``fn`` wrapped for in-process restart: calling the result runs
    :class:`InProcessRestarter`."""

    def run() -> T:
        return InProcessRestarter(options, init_group, **kwargs).run(fn)

    return run
