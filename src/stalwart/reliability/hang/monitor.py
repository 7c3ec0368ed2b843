"""Per-rank hang monitor process and the heartbeat record it shares with its worker.

This file is deliberately standard-library only and imports nothing from stalwart: the worker
starts it as a *script* (``python .../monitor.py``), so it never imports torch and never runs a
package ``__init__`` that might. It starts in tens of milliseconds and cannot be blocked by the
worker's GIL, a stuck CUDA call or a hung collective, because it is a separate process.

Protocol
--------
The worker (``stalwart.reliability.hang.sections.SectionMonitor``) owns a small memory-mapped file (the
heartbeat record): two slots of layout ``_SLOT``, each the open section, when it opened, when the
last section closed, the live timeouts, a sequence number and a CRC-32 of all that. A write goes
to the slot the last write did not use, in one copy, so a complete record is always in the file
even if the worker stops in the middle of a write; the reader takes the valid slot with the
highest sequence number (a torn slot fails its CRC). The monitor polls the record every
``--poll`` seconds and:

* exits quietly (``MonitorExit.WORKER_CLOSED``) when the worker set the *closed* flag;
* exits (``MonitorExit.WORKER_GONE``) when the worker died (it was re-parented, or the pid is gone);
* when the open section, or the time outside any section once *armed*, overruns its timeout: logs
  rank, section, duration and timeout, asks the worker for a stack dump (the worker registered
  ``faulthandler`` for ``--dump-signal``; output lands in ``--stack-file``, which is copied into
  the log), runs ``py-spy dump`` if it is installed, kills the worker with SIGKILL (after an
  optional SIGTERM grace) so that the launcher (torchrun) sees a failed worker and restarts the
  job, writes ``ft_hang_rank<R>.json`` next to the log, and exits (``MonitorExit.KILLED_WORKER``).
* when no slot is valid (the file was overwritten or truncated): counts it as *no progress*. The
  last valid record keeps being judged (its open section keeps ageing); when there was none, or
  it had nothing open, the time since the record became unreadable is judged against the longest
  timeout (``--fallback-timeout`` before any valid record). Hang detection never switches off.

The monitor ignores SIGINT and SIGTERM: during a graceful exit it keeps watching the final save,
and it always ends on its own once the worker is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import faulthandler
import json
import math
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from typing import IO

MAGIC = b"STLWHB01"
SECTION_NAMES: tuple[str, ...] = ("setup", "step", "checkpointing")
OUT_OF_SECTION = "out_of_section"
NO_SECTION = -1

FLAG_CLOSED = 1
FLAG_OUT_OF_SECTION_ARMED = 2

# magic, seq, section id, flags, section_start, last_close, last_update,
# timeouts (setup, step, checkpointing, out_of_section), then a CRC-32 of the bytes before it.
# Times are time.monotonic() seconds, which is one system-wide clock on Linux, so both processes
# read the same time base.
_FIELDS = struct.Struct("<8sqiiddddddd")
_CRC = struct.Struct("<I4x")
SLOT_SIZE = _FIELDS.size + _CRC.size
RECORD_SIZE = 2 * SLOT_SIZE  # two slots: a write never touches the last complete record
UNREADABLE = "unreadable heartbeat record"


class MonitorExit(enum.IntEnum):
    """Exit status of the monitor process."""

    WORKER_CLOSED = 0
    WORKER_GONE = 1
    KILLED_WORKER = 3


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of the heartbeat record."""

    section: int
    flags: int
    section_start: float
    last_close: float
    last_update: float
    timeouts: tuple[float, float, float, float]

    @property
    def closed(self) -> bool:
        return bool(self.flags & FLAG_CLOSED)


@dataclass(frozen=True)
class Overrun:
    """A section (or the out-of-section gap) that has been open longer than its timeout."""

    section: str
    elapsed_s: float
    timeout_s: float


def pack_record(
    seq: int,
    section: int,
    flags: int,
    section_start: float,
    last_close: float,
    last_update: float,
    timeouts: tuple[float, float, float, float],
) -> bytes:
    """One slot: the fields and their CRC-32."""
    fields = _FIELDS.pack(
        MAGIC, seq, section, flags, section_start, last_close, last_update, *timeouts
    )
    return fields + _CRC.pack(zlib.crc32(fields))


def write_record(buf: mmap.mmap, seq: int, slot: bytes) -> None:
    """Write ``slot`` (from `pack_record` with ``seq``) into the slot the previous write left alone.

    One copy into a slot that no reader is relying on: the other slot still holds the previous
    complete record, so a worker stopped mid-write never leaves the file without one.
    """
    offset = (seq % 2) * SLOT_SIZE
    buf[offset : offset + SLOT_SIZE] = slot


def _unpack_slot(raw: bytes) -> tuple[int, Snapshot] | None:
    fields, (crc,) = raw[: _FIELDS.size], _CRC.unpack(raw[_FIELDS.size :])
    if zlib.crc32(fields) != crc:
        return None
    magic, seq, section, flags, start, close, update, *timeouts = _FIELDS.unpack(fields)
    if magic != MAGIC:
        return None
    t = (float(timeouts[0]), float(timeouts[1]), float(timeouts[2]), float(timeouts[3]))
    return int(seq), Snapshot(
        int(section), int(flags), float(start), float(close), float(update), t
    )


def read_snapshot(buf: mmap.mmap, retries: int = 3) -> Snapshot | None:
    """The newest valid slot; None when neither slot is valid (after a few quick retries)."""
    for attempt in range(retries):
        raw = bytes(buf[:RECORD_SIZE])
        slots = [_unpack_slot(raw[i * SLOT_SIZE : (i + 1) * SLOT_SIZE]) for i in (0, 1)]
        valid = [slot for slot in slots if slot is not None]
        if valid:
            return max(valid, key=lambda slot: slot[0])[1]
        if attempt + 1 < retries:
            time.sleep(0.001)  # both slots mid-write is a race of microseconds: look again
    return None


def find_overrun(snap: Snapshot, now: float) -> Overrun | None:
    """Pure check: which timeout, if any, has ``snap`` exceeded at monotonic time ``now``."""
    if 0 <= snap.section < len(SECTION_NAMES):
        elapsed = now - snap.section_start
        timeout = snap.timeouts[snap.section]
        if elapsed > timeout:
            return Overrun(SECTION_NAMES[snap.section], elapsed, timeout)
        return None
    if snap.flags & FLAG_OUT_OF_SECTION_ARMED:
        elapsed = now - snap.last_close
        timeout = snap.timeouts[3]
        if elapsed > timeout:
            return Overrun(OUT_OF_SECTION, elapsed, timeout)
    return None


def judge(
    last_good: Snapshot | None,
    unreadable_since: float | None,
    now: float,
    fallback_timeout_s: float,
) -> Overrun | None:
    """Pure: the overrun, if any, counting an unreadable record as no progress.

    ``last_good`` is the newest valid record seen, ``unreadable_since`` when the record stopped
    being valid (None while it is valid). The last valid record keeps being judged; if it cannot
    overrun (nothing open, not armed) or there never was one, the time unreadable is judged
    against its longest timeout (``fallback_timeout_s`` without a record).
    """
    if last_good is not None:
        over = find_overrun(last_good, now)
        if over is not None or unreadable_since is None:
            return over
    if unreadable_since is None:
        return None
    timeout = max(last_good.timeouts) if last_good is not None else fallback_timeout_s
    elapsed = now - unreadable_since
    return Overrun(UNREADABLE, elapsed, timeout) if elapsed > timeout else None


class _Log:
    """Writes each line to stderr (the launcher's per-rank log) and to an optional file."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._prefix = f"[stalwart-ft monitor rank {rank}] "
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def line(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        for raw in text.splitlines() or [""]:
            msg = f"{stamp} {self._prefix}{raw}\n"
            sys.stderr.write(msg)
            if self._file is not None:
                self._file.write(msg)
        sys.stderr.flush()
        if self._file is not None:
            self._file.flush()


def _worker_alive(pid: int, parent_pid: int) -> bool:
    if os.getppid() != parent_pid:
        return False  # re-parented: the worker (our parent) has exited
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _collect_stack_dump(pid: int, dump_signal: int, stack_file: str | None, wait_s: float) -> str:
    """Ask the worker's faulthandler for all threads' stacks and return what it wrote."""
    start_size = os.path.getsize(stack_file) if stack_file and os.path.exists(stack_file) else 0
    try:
        os.kill(pid, dump_signal)
    except ProcessLookupError:
        return "(worker already gone; no stack dump)"
    if not stack_file:
        return "(stack dump went to the worker's stderr)"
    deadline = time.monotonic() + wait_s
    last_size, stable_since = start_size, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        size = os.path.getsize(stack_file) if os.path.exists(stack_file) else 0
        if size != last_size:
            last_size, stable_since = size, time.monotonic()
        elif size > start_size and time.monotonic() - stable_since > 0.15:
            break
    if last_size <= start_size:
        return "(no stack dump arrived; faulthandler not registered or process stopped)"
    with open(stack_file, encoding="utf-8", errors="replace") as f:
        f.seek(start_size)
        return f.read()


def _py_spy_dump(pid: int, timeout_s: float = 10.0) -> str | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump failed: {exc})"
    return out.stdout + out.stderr


def _kill(pid: int, term_grace_s: float) -> None:
    if term_grace_s > 0:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + term_grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _write_hang_report(path: str, report: dict[str, object]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def handle_overrun(args: argparse.Namespace, log: _Log, overrun: Overrun) -> None:
    """Report the hang, dump stacks, kill the worker. Never raises for a vanished worker."""
    log.line(
        f"HANG: rank {args.rank} (pid {args.pid}) section '{overrun.section}' open for "
        f"{overrun.elapsed_s:.2f} s > timeout {overrun.timeout_s:.2f} s; dumping stacks, then "
        "killing the worker so that the launcher restarts the job"
    )
    dump = _collect_stack_dump(args.pid, args.dump_signal, args.stack_file, args.dump_wait)
    log.line("stack dump (faulthandler, all threads):\n" + dump.rstrip())
    spy = _py_spy_dump(args.pid)
    if spy is not None:
        log.line("py-spy dump:\n" + spy.rstrip())
    _kill(args.pid, args.term_grace)
    log.line(f"killed worker pid {args.pid} (rank {args.rank})")
    if args.report_file:
        report: dict[str, object] = {
            "rank": args.rank,
            "pid": args.pid,
            "section": overrun.section,
            "elapsed_s": round(overrun.elapsed_s, 3),
            "timeout_s": overrun.timeout_s,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        try:
            _write_hang_report(args.report_file, report)
        except OSError as exc:
            log.line(f"could not write {args.report_file}: {exc}")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def run_monitor(args: argparse.Namespace) -> int:
    """Poll the heartbeat record until the worker closes, dies, or overruns a timeout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = _Log(args.log_file, args.rank)
    with open(args.heartbeat, "rb") as f:
        buf = mmap.mmap(f.fileno(), RECORD_SIZE, access=mmap.ACCESS_READ)
    last_good: Snapshot | None = None
    unreadable_since: float | None = None
    try:
        while True:
            if not _worker_alive(args.pid, args.parent_pid):
                _unlink(args.heartbeat)  # the worker cannot clean up after a crash
                return MonitorExit.WORKER_GONE
            snap = read_snapshot(buf)
            now = time.monotonic()
            if snap is None and unreadable_since is None:
                unreadable_since = now
                log.line(
                    f"heartbeat record {args.heartbeat} is unreadable; counting it as no "
                    "progress (hang detection stays on)"
                )
            elif snap is not None:
                if unreadable_since is not None:
                    log.line(f"heartbeat record {args.heartbeat} is readable again")
                last_good, unreadable_since = snap, None
                if snap.closed:
                    return MonitorExit.WORKER_CLOSED
            overrun = judge(last_good, unreadable_since, now, args.fallback_timeout)
            if overrun is not None:
                handle_overrun(args, log, overrun)
                _unlink(args.heartbeat)
                return MonitorExit.KILLED_WORKER
            time.sleep(args.poll)
    finally:
        buf.close()


# ---------------------------------------------------------------------------------------------
# Worker side: owns the heartbeat record and the monitor process.


def _heartbeat_dir() -> str:
    shm = "/dev/shm"  # tmpfs: the record never touches a disk or a network filesystem
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class MonitorClient:
    """The worker's end: creates the heartbeat record, publishes into it, runs the monitor.

    Args:
        rank: the worker's rank (for log lines and file names).
        log_dir: receives ``monitor_rank<R>.log``, ``stacks_rank<R>.txt`` and, after a hang,
            ``ft_hang_rank<R>.json``.
        poll_s, dump_wait_s, term_grace_s: forwarded to the monitor process.
        fallback_timeout_s: how long the monitor waits on a record that was never readable.
        dump_signal: registered with ``faulthandler`` in this process; the monitor sends it.
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
    ) -> None:
        self.rank, self.log_dir = rank, log_dir
        self._opts = {
            "--poll": poll_s,
            "--dump-wait": dump_wait_s,
            "--term-grace": term_grace_s,
            "--fallback-timeout": fallback_timeout_s,
        }
        self._dump_signal = dump_signal
        self._lock = threading.Lock()
        self._seq = 0
        fd, self.heartbeat_path = tempfile.mkstemp(
            prefix=f"stalwart-hb-r{rank}-", dir=_heartbeat_dir()
        )
        os.ftruncate(fd, RECORD_SIZE)
        self._buf = mmap.mmap(fd, RECORD_SIZE)
        os.close(fd)
        self._stack_file: IO[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

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
            slot = pack_record(self._seq, section, flags, section_start, last_close, now, timeouts)
            write_record(self._buf, self._seq, slot)

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
        argv = [item for key, value in opts.items() for item in (key, str(value))]
        # -I (isolated): no script directory or user site on sys.path; only stdlib is needed.
        cmd = [sys.executable, "-I", "-u", os.path.abspath(__file__), *argv]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Reap the monitor (publish a record with FLAG_CLOSED first), clean up; idempotent.

        Returns the monitor's exit status, or None if it was never started.
        """
        status = None
        if self._proc is not None:
            try:
                status = self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                status = self._proc.wait()
        if self._stack_file is not None:
            faulthandler.unregister(self._dump_signal)
            self._stack_file.close()
            self._stack_file = None
        with self._lock:
            if not self._buf.closed:
                self._buf.close()
        _unlink(self.heartbeat_path)
        return status


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The monitor process's command line (the worker's `MonitorClient.start` writes it)."""
    p = argparse.ArgumentParser(
        description="stalwart per-rank hang monitor (started by the worker)", allow_abbrev=False
    )
    p.add_argument("--heartbeat", required=True, help="memory-mapped heartbeat record")
    p.add_argument("--pid", type=int, required=True, help="worker pid to watch and kill")
    p.add_argument("--parent-pid", type=int, required=True, help="expected parent pid (the worker)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--poll", type=_positive, default=1.0, help="seconds between polls")
    p.add_argument("--dump-signal", type=int, default=int(signal.SIGUSR2))
    p.add_argument(
        "--dump-wait", type=_positive, default=1.0, help="max seconds to wait for a dump"
    )
    p.add_argument("--term-grace", type=_positive, default=0.0, help="SIGTERM grace before SIGKILL")
    p.add_argument(
        "--fallback-timeout",
        type=_positive,
        default=600.0,
        help="seconds a record that was never readable is tolerated",
    )
    p.add_argument("--stack-file", default=None)
    p.add_argument("--log-file", default=None)
    p.add_argument("--report-file", default=None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return int(run_monitor(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
