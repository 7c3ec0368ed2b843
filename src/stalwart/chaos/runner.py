"""Launch ``stalwart train`` under torchrun, watch its merged, time-stamped output, act on it.

Each launch runs in its own session (``killpg`` reaches torchrun and its workers and nothing
else); a thread collects every output line with its arrival time, which the scenarios use to
measure detection and recovery times. The whole output is also written to a log file.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
RESUMED_RE = re.compile(r"resumed from (\S+) at iteration (\d+)")
WORKER_EXIT_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# Inherited variables that would change what a launch does; each scenario sets its own.
SCRUBBED_ENV = ("STALWART_DEVICE_ID", "STALWART_JOB_ID")


@dataclass
class LaunchSpec:
    """One torchrun invocation of ``stalwart train``.

    ``fsize_limit``: RLIMIT_FSIZE in bytes for torchrun and its workers (a write past it fails
    with EFBIG, even for root, which a read-only directory would not stop).
    """

    train_args: list[str]
    nproc: int
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    fsize_limit: int | None = None
    launcher: list[str] | None = None  # the command before the train args; default torchrun's


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """torchrun through `stalwart.distributed.torchrun` (torchrun itself, with a cheap exit),
    or ``spec.launcher`` (``stalwart launch ... --``) followed by the train args."""
    if spec.launcher is not None:
        return [*spec.launcher, *spec.train_args]
    return [
        sys.executable,
        "-m",
        "stalwart.distributed.torchrun",
        "--standalone",
        "--nproc-per-node",
        str(spec.nproc),
        "--max-restarts",
        str(spec.max_restarts),
        "--monitor-interval",
        "0.2",
        "-m",
        "stalwart",
        "train",
        *spec.train_args,
    ]


def launch_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # pytorch#135712: a restarted gloo group may read the previous attempt's peer addresses
        # from the rendezvous store shared with the workers.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.update(extra)
    return env


class Job:
    """A running launch; ``lines`` holds ``(arrival time, line)`` of stdout and stderr merged."""

    def __init__(self, spec: LaunchSpec, log_path: Path) -> None:
        self.spec = spec
        self.started = time.time()
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        limit = spec.fsize_limit

        def preexec() -> None:  # runs in the child before exec; inherited by the workers
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the pump)
        self._log.write(" ".join(torchrun_command(spec)) + "\n")
        self.proc = subprocess.Popen(
            torchrun_command(spec),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=launch_env(spec.env),
            start_new_session=True,
            preexec_fn=preexec if limit is not None else None,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.time()
            self._log.write(line)
            with self._cond:
                self.lines.append((now, line.rstrip("\n")))
                self._cond.notify_all()
        self._log.close()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """True once ``predicate()`` holds (checked per line and every 50 ms); False on timeout
        or when the job ended without it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return bool(predicate())
                self._cond.wait(min(left, 0.05))
        return True

    def worker_pid(self, rank: int) -> int | None:
        """PID of the live worker process with ``RANK=rank`` (a child of torchrun): its
        environment says so, or, forked from ``stalwart launch --fork-workers`` (the launcher's
        environment), its name ``stalwart-r<rank>``."""
        for pid in _children(self.proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ or name == f"stalwart-r{rank}":
                return pid
        return None

    def wait(self, timeout: float) -> int:
        """The launcher's exit code; on timeout the whole session is killed and -9 returned."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            code = -9
            self.lines.append((time.time(), f"CHAOS RUNNER: killed after {timeout:.0f} s"))
        except BaseException:  # Ctrl-C of the harness: leave no training job behind
            self.kill()
            raise
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


@dataclass
class LaunchResult:
    """A finished launch: exit code, timing, output."""

    code: int
    started: float
    ended: float
    lines: list[tuple[float, str]]
    worker_exits: list[tuple[int, int]]  # (exit code, local rank) per failure torchrun reported

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first_time(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)

    def iterations(self) -> list[tuple[float, int]]:
        """``(time, iteration)`` of every training-log line, in order."""
        return [(t, int(m.group(1))) for t, line in self.lines if (m := ITERATION_RE.search(line))]

    def resumes(self) -> list[tuple[float, str, int]]:
        """``(time, path, iteration)`` of every "resumed from" line."""
        return [
            (t, m.group(1), int(m.group(2)))
            for t, line in self.lines
            if (m := RESUMED_RE.search(line))
        ]

    def first_iteration_after(self, since: float, above: int) -> float | None:
        """Time of the first training-log line at or after ``since`` with an iteration >
        ``above``."""
        return next((t for t, it in self.iterations() if t >= since and it > above), None)

    def worker_code(self) -> int:
        """The root-cause worker exit code: torchrun's first reported failure, else the
        launcher's."""
        return self.worker_exits[0][0] if self.worker_exits else self.code


def finish(job: Job, timeout: float) -> LaunchResult:
    code = job.wait(timeout)
    exits = [
        (int(m.group(1)), int(m.group(2)))
        for _, line in job.lines
        if (m := WORKER_EXIT_RE.search(line))
    ]
    return LaunchResult(code, job.started, time.time(), list(job.lines), exits)


def run(spec: LaunchSpec, log_path: Path, timeout: float) -> LaunchResult:
    """Launch and wait (killing the launch after ``timeout`` seconds)."""
    return finish(Job(spec, log_path), timeout)
