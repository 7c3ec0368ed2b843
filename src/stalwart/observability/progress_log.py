"""``--log-progress``: Megatron's ``<save>/progress.txt``, one tab-separated line per event.

The lines are Megatron's, so the tools that read its file read ours::

    2026-01-01 12:00:00<TAB>Job ID: 4242<TAB># GPUs: 8<TAB>Starting job
    2026-01-01 12:30:00<TAB>Job ID: 4242<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 500<TAB>
        Job throughput: 312.4 TFLOP/s/GPU<TAB>Cumulative throughput: 305.1 TFLOP/s/GPU<TAB>
        Floating-point operations: 4.49e+18<TAB>Tokens (in billions): 0.52

(one line; ``Saving async checkpoint`` with ``--async-save``). Job throughput is this job's
floating-point operations since it started over its wall time, per GPU; cumulative throughput
counts from the first ``Starting job`` line of the current world size, starting at the
operations of the last checkpoint saved before it, as Megatron reads the file. A line that is
not valid (another tool's, a torn last line, a date out of range, a NaN) is skipped with one
warning naming the file and the line (:func:`parse_line` checks every line). Only rank 0 writes.

Usage::

    log = ProgressLogConfig(log_progress=True).build("ckpt", world_size=8, rank=0)
    log.start(flops_so_far=0.0)
    ...
    log.on_save(iteration=500, flops_so_far=4.49e18, tokens=5.2e8, async_save=False)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.distributed.launch_env import env_token
from stalwart.regular_file import open_regular

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING = "Starting job"
SAVED = "Saved checkpoint"
SAVING_ASYNC = "Saving async checkpoint"


def format_line(when: dt.datetime, job_id: str, world_size: int, message: str) -> str:
    """One line of the file (without the newline)."""
    return f"{when.strftime(TIME_FORMAT)}\tJob ID: {job_id}\t# GPUs: {world_size}\t{message}"


def saved_message(
    iteration: int,
    job_tflops: float,
    cumulative_tflops: float,
    flops_so_far: float,
    tokens: float,
    async_save: bool,
) -> str:
    """The message of a persistent save (Megatron's fields and units)."""
    return (
        f"{SAVING_ASYNC if async_save else SAVED}\tIteration: {iteration}\t"
        f"Job throughput: {job_tflops:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {cumulative_tflops:.1f} TFLOP/s/GPU\t"
        f"Floating-point operations: {flops_so_far:.2e}\t"
        f"Tokens (in billions): {tokens / 1e9:.2f}"
    )


# A line later than the writer's clock by more than this is out of range (the hosts of one job
# agree on the time; a far-future start made every cumulative throughput negative).
FUTURE_SLACK_S = 60.0


@dataclass(frozen=True)
class ProgressEntry:
    """One valid line of the file."""

    when: float  # POSIX seconds of its date (local time, as Megatron writes it)
    world_size: int
    event: str
    flops: float  # ``Floating-point operations`` of a save line; 0.0 on other lines


def parse_line(line: str, now: float | None = None) -> ProgressEntry:
    """One line -> its entry; ``ValueError`` saying why it is not one (never another error).

    A date that does not parse or is out of range (year 1, after ``now`` + 60 s), a world size
    that is not a positive count, a save line whose operations are not a finite count: invalid.
    """
    tokens = line.rstrip("\n").split("\t")
    if len(tokens) < 4:
        raise ValueError("not a progress line (fewer than 4 tab-separated fields)")
    try:
        when = dt.datetime.strptime(tokens[0], TIME_FORMAT).timestamp()
    except (ValueError, OverflowError, OSError):  # year 1: before the platform's epoch range
        raise ValueError(f"date {tokens[0][:40]!r} is not a time ({TIME_FORMAT})") from None
    ceiling = (time.time() if now is None else now) + FUTURE_SLACK_S
    if not 0.0 <= when <= ceiling:
        raise ValueError(f"date {tokens[0]!r} is out of range (the epoch to now)")
    world = _number(tokens[2], "# GPUs", int)
    if not 0 < world < 2**31:
        raise ValueError(f"'# GPUs' {world} is not a positive count")
    event, flops = tokens[3], 0.0
    if event in (SAVED, SAVING_ASYNC):
        flops = _number(tokens[7] if len(tokens) > 7 else "", "Floating-point operations", float)
        if not (math.isfinite(flops) and flops >= 0.0):
            raise ValueError(f"'Floating-point operations' {flops} is not a finite count")
    return ProgressEntry(when, world, event, flops)


def _number(token: str, key: str, kind: type[int] | type[float]) -> Any:
    name, _, value = token.partition(": ")
    if name != key:
        raise ValueError(f"no {key!r} field where it belongs")
    try:
        return kind(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{key!r} {value[:40]!r} is not a number") from None


def cumulative_start(
    lines: Iterable[str], world_size: int, now: float | None = None
) -> tuple[dt.datetime | None, float]:
    """(time of the first ``Starting job`` line of the current run of ``world_size`` lines,
    operations of the last checkpoint saved before it); ``(None, 0.0)`` if there is none.

    A line of another world size restarts the search (Megatron's rule: cumulative throughput
    is per world size). Invalid lines (:func:`parse_line`) are skipped.
    """
    entries = []
    for line in lines:
        with contextlib.suppress(ValueError):
            entries.append(parse_line(line, now))
    start = _cumulative_start(entries, world_size)
    return (None, 0.0) if start is None else (dt.datetime.fromtimestamp(start[0]), start[1])


def _cumulative_start(
    entries: Iterable[ProgressEntry], world_size: int
) -> tuple[float, float] | None:
    start: float | None = None
    start_flops, latest_flops = 0.0, 0.0
    for entry in entries:
        if entry.event in (SAVED, SAVING_ASYNC):
            latest_flops = entry.flops
        if entry.world_size != world_size:
            start = None
            continue
        if entry.event == STARTING and start is None:
            start, start_flops = entry.when, latest_flops
    return None if start is None else (start, start_flops)


class ProgressLog:
    """Appends to ``<save_dir>/progress.txt`` (rank 0 only; see the module docstring).

    The file is read back at every save (the cumulative throughput's start); an invalid line
    is skipped with one warning naming the file and the line (once per line and job), and a
    failed append is a warning: neither may fail the run after its checkpoint committed."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        world_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(save_dir) / PROGRESS_FILE
        self.world_size = world_size
        self.clock = clock
        self.job_id = env_token("SLURM_JOB_ID", "")
        self._started_at = clock()
        self._flops_at_start = 0.0
        self._warned: set[int] = set()

    def _append(self, message: str) -> None:
        when = dt.datetime.fromtimestamp(self.clock())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = format_line(when, self.job_id, self.world_size, message) + "\n"
            with open(self.path, "a+b") as f:  # appends go to the end whatever the position
                size = f.seek(0, os.SEEK_END)
                if size and (f.seek(size - 1) is None or f.read(1) != b"\n"):
                    line = "\n" + line  # end a torn last line: ours must stay a line of its own
                f.write(line.encode("utf-8"))
        except OSError as exc:  # a full disk must not fail a run whose checkpoint committed
            logger.warning("progress.txt: cannot append to %s: %s", self.path, exc)

    def start(self, flops_so_far: float) -> None:
        """The job starts (after loading its checkpoint: ``flops_so_far`` done before it)."""
        self._started_at, self._flops_at_start = self.clock(), flops_so_far
        self._append(STARTING)

    def _entries(self) -> list[ProgressEntry]:
        """The file's valid lines; the invalid ones not warned about yet get one warning."""
        try:
            with open_regular(self.path) as f:  # a FIFO planted there would block the save
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []
        entries, bad = [], []
        now = self.clock()
        for number, line in enumerate(lines, start=1):
            try:
                entries.append(parse_line(line, now))
            except ValueError as exc:
                if number not in self._warned:
                    bad.append(f"line {number}: {exc}")
                    self._warned.add(number)
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            logger.warning(
                "progress.txt %s: skipped %d invalid line(s) (%s%s)",
                self.path,
                len(bad),
                "; ".join(bad[:3]),
                more,
            )
        return entries

    def on_save(self, iteration: int, flops_so_far: float, tokens: float, async_save: bool) -> None:
        """A persistent checkpoint at ``iteration`` was written (or, async, started)."""
        now = self.clock()
        per_gpu = 1e12 * self.world_size
        job = (flops_so_far - self._flops_at_start) / (max(now - self._started_at, 1e-9) * per_gpu)
        start = _cumulative_start(self._entries(), self.world_size)
        if start is None:  # the file lost its start line: count from this job
            start = (self._started_at, self._flops_at_start)
        cumulative = (flops_so_far - start[1]) / (max(now - start[0], 1e-9) * per_gpu)
        self._append(saved_message(iteration, job, cumulative, flops_so_far, tokens, async_save))


class NullProgressLog:
    """``--log-progress`` off (or not rank 0): nothing is written."""

    def start(self, flops_so_far: float) -> None: ...

    def on_save(
        self, iteration: int, flops_so_far: float, tokens: float, async_save: bool
    ) -> None: ...


@dataclass(kw_only=True, frozen=True)
class ProgressLogConfig:
    """``--log-progress``: Megatron's ``<save>/progress.txt`` (needs a save directory)."""

    log_progress: bool = False

    def build(
        self, save_dir: str | None, world_size: int, rank: int
    ) -> ProgressLog | NullProgressLog:
        """Rank 0's progress log when ``log_progress`` is on, else the null one."""
        if not self.log_progress or rank != 0:
            return NullProgressLog()
        if save_dir is None:
            raise ValueError("--log-progress needs --save (progress.txt is written there)")
        return ProgressLog(save_dir, world_size)
