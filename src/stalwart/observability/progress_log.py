"""``--log-progress``: Megatron's ``<save>/progress.txt``, one tab-separated line per event.

The lines are Megatron's, so the tools that read its file read ours::

    2026-01-01 12:00:00<TAB>Job ID: 4242<TAB># GPUs: 8<TAB>Starting job
    2026-01-01 12:30:00<TAB>Job ID: 4242<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 500<TAB>
        Job throughput: 312.4 TFLOP/s/GPU<TAB>Cumulative throughput: 305.1 TFLOP/s/GPU<TAB>
        Floating-point operations: 4.49e+18<TAB>Tokens (in billions): 0.52

(one line; ``Saving async checkpoint`` with ``--async-save``). Job throughput is this job's
floating-point operations since it started over its wall time, per GPU; cumulative throughput
counts from the first ``Starting job`` line of the current world size, starting at the
operations of the last checkpoint saved before it, as Megatron reads the file. A line that does
not parse (another tool's, or a torn last line) is skipped. Only rank 0 writes.

Usage::

    log = make_progress_log(enabled=True, save_dir="ckpt", world_size=8, rank=0)
    log.start(flops_so_far=0.0)
    ...
    log.on_save(iteration=500, flops_so_far=4.49e18, tokens=5.2e8, async_save=False)
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from stalwart.distributed.launch_env import env_token
from stalwart.regular_file import open_regular

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


def _field(token: str) -> str:
    return token.split(": ", 1)[1]


def cumulative_start(lines: Iterable[str], world_size: int) -> tuple[dt.datetime | None, float]:
    """(time of the first ``Starting job`` line of the current run of ``world_size`` lines,
    operations of the last checkpoint saved before it); ``(None, 0.0)`` if there is none.

    A line of another world size restarts the search (Megatron's rule: cumulative throughput
    is per world size). Unparseable lines are skipped.
    """
    start: dt.datetime | None = None
    start_flops, latest_flops = 0.0, 0.0
    for line in lines:
        tokens = line.rstrip("\n").split("\t")
        try:
            when = dt.datetime.strptime(tokens[0], TIME_FORMAT)
            world = int(_field(tokens[2]))
            event = tokens[3]
            if event in (SAVED, SAVING_ASYNC):
                latest_flops = float(_field(tokens[7]))
        except (IndexError, ValueError):
            continue
        if world != world_size:
            start = None
            continue
        if event == STARTING and start is None:
            start, start_flops = when, latest_flops
    return start, start_flops


class ProgressLog:
    """Appends to ``<save_dir>/progress.txt`` (rank 0 only; see the module docstring)."""

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

    def _append(self, message: str) -> None:
        when = dt.datetime.fromtimestamp(self.clock())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(format_line(when, self.job_id, self.world_size, message) + "\n")

    def start(self, flops_so_far: float) -> None:
        """The job starts (after loading its checkpoint: ``flops_so_far`` done before it)."""
        self._started_at, self._flops_at_start = self.clock(), flops_so_far
        self._append(STARTING)

    def _lines(self) -> list[str]:
        try:
            with open_regular(self.path) as f:  # a FIFO planted there would block the save
                return f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def on_save(self, iteration: int, flops_so_far: float, tokens: float, async_save: bool) -> None:
        """A persistent checkpoint at ``iteration`` was written (or, async, started)."""
        now = self.clock()
        per_gpu = 1e12 * self.world_size
        job = (flops_so_far - self._flops_at_start) / (max(now - self._started_at, 1e-9) * per_gpu)
        start, start_flops = cumulative_start(self._lines(), self.world_size)
        if start is None:  # the file lost its start line: count from this job
            start_s, start_flops = self._started_at, self._flops_at_start
        else:
            start_s = start.timestamp()
        cumulative = (flops_so_far - start_flops) / (max(now - start_s, 1e-9) * per_gpu)
        self._append(saved_message(iteration, job, cumulative, flops_so_far, tokens, async_save))


class NullProgressLog:
    """``--log-progress`` off (or not rank 0): nothing is written."""

    def start(self, flops_so_far: float) -> None:
        del flops_so_far

    def on_save(self, iteration: int, flops_so_far: float, tokens: float, async_save: bool) -> None:
        del iteration, flops_so_far, tokens, async_save


def make_progress_log(
    enabled: bool, save_dir: str | None, world_size: int, rank: int
) -> ProgressLog | NullProgressLog:
    """The progress log of rank 0 when ``--log-progress`` is on, else the null one."""
    if not enabled or save_dir is None or rank != 0:
        return NullProgressLog()
    return ProgressLog(save_dir, world_size)
