"""The worker's end of the hang monitor: the heartbeat record it publishes into, the monitor
process it starts, and the listener that lets the monitor abort its process groups.

Split from :mod:`stalwart.reliability.hang.monitor`, which runs as a standard-library-only script
(this side runs in the worker and may import the rest of stalwart).
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from stalwart.reliability.hang import monitor as hb
from stalwart.reliability.hang.abort_listener import AbortListener


def _heartbeat_dir() -> str:
    shm = "/dev/shm"  # tmpfs: the record never touches a disk or a network filesystem
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


# ProcessGroupNCCL's flight recorder: a named pipe per rank that triggers a dump (torch reads
# these when it creates the group; see `enable_flight_recorder`).
FLIGHT_RECORDER_PIPE = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
FLIGHT_RECORDER_DUMP = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FLIGHT_RECORDER_BUFFER = "TORCH_NCCL_TRACE_BUFFER_SIZE"


def enable_flight_recorder(log_dir: str) -> None:
    """Before the process group exists: keep NCCL's flight recorder on and its dump pipe in
    ``log_dir`` (the hang monitor's soft tier writes to the pipe). Variables the user set win."""
    os.makedirs(log_dir, exist_ok=True)
    prefix = os.path.join(log_dir, "nccl_trace_rank")
    os.environ.setdefault(FLIGHT_RECORDER_BUFFER, "2000")
    os.environ.setdefault(FLIGHT_RECORDER_DUMP, prefix)
    os.environ.setdefault(FLIGHT_RECORDER_PIPE, prefix)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # a process-group timeout dumps too


def flight_recorder_paths(rank: int) -> dict[str, str]:
    """The monitor's ``--nccl-pipe`` / ``--nccl-dump`` from this process's environment."""
    pipe = os.environ.get(FLIGHT_RECORDER_PIPE)
    if not pipe:
        return {}
    dump = os.environ.get(FLIGHT_RECORDER_DUMP, "/tmp/nccl_trace_rank_")
    return {"--nccl-pipe": f"{pipe}{rank}.pipe", "--nccl-dump": f"{dump}{rank}"}


class MonitorClient:
    """The worker's end: creates the heartbeat record, publishes into it, runs the monitor.

    Args:
        rank: the worker's rank (for log lines and file names).
        log_dir: receives ``monitor_rank<R>.log``, ``stacks_rank<R>.txt`` and, after a hang,
            ``ft_hang_rank<R>.json``.
        poll_s, dump_wait_s, term_grace_s: forwarded to the monitor process.
        fallback_timeout_s: how long the monitor waits on a record that was never readable.
        dump_signal: registered with ``faulthandler`` in this process; the monitor sends it.
        abort_grace_s: after the hard tier's abort, how long the rank may take to exit itself.
        goodput_file: the run's ``goodput.jsonl``: a hang appends a ``fault`` record to it.
    """

    def __init__(
        self,
        rank: int,
        log_dir: str,
        *,
        poll_s: float,
        dump_signal: int,
        dump_wait_s: float,
        term_grace_s: float,
        fallback_timeout_s: float = 600.0,
        abort_grace_s: float = 2.0,
        goodput_file: str | None = None,
    ) -> None:
        self.rank, self.log_dir = rank, log_dir
        self._opts: dict[str, object] = {
            "--poll": poll_s,
            "--dump-wait": dump_wait_s,
            "--term-grace": term_grace_s,
            "--fallback-timeout": fallback_timeout_s,
            "--abort-grace": abort_grace_s,
            **({"--goodput-file": goodput_file} if goodput_file else {}),
            **flight_recorder_paths(rank),
        }
        self._listener: AbortListener | None = None
        self._dump_signal = dump_signal
        self._lock = threading.Lock()
        self._seq = 0
        fd, self.heartbeat_path = tempfile.mkstemp(
            prefix=f"stalwart-hb-r{rank}-", dir=_heartbeat_dir()
        )
        os.ftruncate(fd, hb.RECORD_SIZE)
        self._buf = mmap.mmap(fd, hb.RECORD_SIZE)
        os.close(fd)
        self._stack_file: IO[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._wake_fd = -1

    @property
    def pid(self) -> int | None:
        """The monitor process id (None before `start`)."""
        return self._proc.pid if self._proc is not None else None

    def publish(
        self,
        section: int,
        flags: int,
        section_start: float,
        last_close: float,
        timeouts: tuple[float, float, float, float],
    ) -> None:
        """Write the record (thread-safe, microseconds: no syscall, no allocation of note)."""
        with self._lock:
            if self._buf.closed:
                return
            self._seq += 1
            now = time.monotonic()
            slot = hb.pack_record(
                self._seq, section, flags, section_start, last_close, now, timeouts
            )
            hb.write_record(self._buf, self._seq, slot)

    def start(self) -> None:
        """Register the stack-dump handler and start the monitor process (once).

        Publish a first record before calling this: the monitor reads it at once.
        """
        if self._proc is not None:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        stack_path = os.path.join(self.log_dir, f"stacks_rank{self.rank}.txt")
        self._stack_file = open(stack_path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        # faulthandler writes from a C signal handler, so the dump works even while the main
        # thread holds the GIL in a stuck C call or waits in a hung collective.
        faulthandler.register(self._dump_signal, file=self._stack_file, all_threads=True)
        pid = str(os.getpid())
        opts: dict[str, object] = {
            **self._opts,
            "--heartbeat": self.heartbeat_path,
            "--pid": pid,
            "--parent-pid": pid,
            "--rank": self.rank,
            "--dump-signal": self._dump_signal,
            "--stack-file": stack_path,
            "--log-file": os.path.join(self.log_dir, f"monitor_rank{self.rank}.log"),
            "--report-file": os.path.join(self.log_dir, f"ft_hang_rank{self.rank}.json"),
        }
        # The hard tier: the monitor writes to this pipe, a thread here aborts the groups.
        self._listener = AbortListener()
        opts["--abort-fd"], opts["--abort-reply-fd"] = self._listener.monitor_fds
        # The monitor's wake-up: stop() closes the write end after the closing record, so the
        # monitor exits at once instead of at its next poll (up to --poll seconds of every
        # rank's exit, hence of every restart). Non-inheritable: only the monitor gets the read
        # end, and no other child of this worker keeps the write end open.
        wake_read, self._wake_fd = os.pipe()
        opts["--wake-fd"] = wake_read
        argv = [item for key, value in opts.items() for item in (key, str(value))]
        # -I (isolated): no script directory or user site on sys.path; only stdlib is needed.
        cmd = [sys.executable, "-I", "-u", os.path.abspath(hb.__file__), *argv]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(*self._listener.monitor_fds, wake_read),
        )
        os.close(wake_read)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Reap the monitor (publish a record with FLAG_CLOSED first), clean up; idempotent.

        Returns the monitor's exit status, or None if it was never started.
        """
        status = None
        if self._wake_fd >= 0:
            os.close(self._wake_fd)  # the monitor reads the closing record now, not in --poll s
            self._wake_fd = -1
        if self._proc is not None:
            try:
                status = self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                status = self._proc.wait()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._stack_file is not None:
            faulthandler.unregister(self._dump_signal)
            self._stack_file.close()
            self._stack_file = None
        with self._lock:
            if not self._buf.closed:
                self._buf.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.heartbeat_path)
        return status
