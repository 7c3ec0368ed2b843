"""A goodput session's clock and what earlier sessions left: when this process (or torchrun)
started, torchrun's restart count, and the prior ledger's last record and highest iteration.

Standard library only, like the ledger (the CLI reads goodput files without torch).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.observability.goodput.records import (
    FINISHED,
    Bucket,
    LedgerFile,
    Marker,
    RecordKind,
    Span,
)

# The buckets whose spans carry a completed iteration (productive or recomputed work).
ITERATION_BUCKETS = (Bucket.PRODUCTIVE, Bucket.LOST_WORK, Bucket.COMPILE, Bucket.RERUN)


def process_start_time(pid: int | None = None) -> float | None:
    """Wall-clock start of process ``pid`` (default: this one), or None when unknown.

    Linux: ``/proc/<pid>/stat`` start ticks against ``CLOCK_BOOTTIME`` (10 ms resolution; psutil's
    ``create_time`` rounds the boot time to whole seconds). Elsewhere: psutil, if installed.
    """
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # psutil missing, or the process is gone
        return None


LAUNCH_ROUND_ENV = "STALWART_LAUNCH_ROUND"


def launcher_start_time() -> float | None:
    """When this session started: torchrun's process (this worker's parent) for torchrun's
    first round of workers, else this process (a restarted worker: the time before it is the
    previous session's downtime). Under ``stalwart launch`` the parent outlives its rounds:
    only round 0 (``$STALWART_LAUNCH_ROUND``) starts with it, a relaunch's downtime is booked as
    restart (and hang up to a watchdog's detection) like torchrun's own restarts."""
    first_round = torchrun_restart_count() == 0 and _launch_round() == 0
    if "TORCHELASTIC_RUN_ID" in os.environ and first_round:
        parent = process_start_time(os.getppid())
        if parent is not None:
            return parent
    return process_start_time()


def _launch_round() -> int:
    """``STALWART_LAUNCH_ROUND`` (set by ``stalwart launch``; 0 when unset or malformed)."""
    try:
        return max(int(os.environ.get(LAUNCH_ROUND_ENV, "0")), 0)
    except ValueError:
        return 0


def torchrun_restart_count() -> int:
    """``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun or when malformed)."""
    try:
        return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), 0)
    except ValueError:
        return 0


def anchored_clock() -> Callable[[], float]:
    wall0, mono0 = time.time(), time.monotonic()
    return lambda: wall0 + (time.monotonic() - mono0)


def high_water_mark(prior: LedgerFile) -> int:
    """The highest iteration completed since the last finished session (0 when none)."""
    hwm = 0
    for record in prior.records:
        if isinstance(record, Marker) and record.kind is RecordKind.END:
            if record.get("reason") == FINISHED:
                hwm = 0  # a relaunch after a finished job is a new segment
        elif isinstance(record, Span) and record.bucket in ITERATION_BUCKETS:
            hwm = max(hwm, record.iteration or 0)
    return hwm


def previous_end(prior: LedgerFile) -> tuple[float | None, bool, float | None]:
    """(time of the last record, whether the last session ended ``finished``, the first hang
    detection after that time)."""
    last_t: float | None = None
    finished = False
    for record in prior.records:
        if isinstance(record, Span):
            last_t = record.t1 if last_t is None else max(last_t, record.t1)
        elif record.kind in (RecordKind.END, RecordKind.SESSION):
            last_t = record.t if last_t is None else max(last_t, record.t)
            finished = record.kind is RecordKind.END and record.get("reason") == FINISHED
    hangs = [
        r.t
        for r in prior.records
        if isinstance(r, Marker)
        and r.kind is RecordKind.FAULT
        and r.get("cause") == "hang"
        and last_t is not None
        and r.t > last_t
    ]
    return last_t, finished, min(hangs, default=None)
