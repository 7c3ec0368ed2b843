"""Per-rank hang monitor process and the heartbeat record it shares with its worker.

This file is deliberately standard-library only and imports nothing from stalwart: the worker
starts it as a *script* (``python .../monitor.py``), so it never imports torch and never runs a
package ``__init__`` that might. It starts in tens of milliseconds and cannot be blocked by the
worker's GIL, a stuck CUDA call or a hung collective, because it is a separate process.

Protocol
--------
The worker (``stalwart.reliability.hang.sections.SectionMonitor``) owns a small memory-mapped file
(the heartbeat record): two slots of layout ``_SLOT``, each the open section, when it opened, when
the last section closed, the live timeouts, a sequence number and a CRC-32 of all that. A write goes
to the slot the last write did not use, in one copy, so a complete record is always in the file
even if the worker stops in the middle of a write; the reader takes the valid slot with the
highest sequence number (a torn slot fails its CRC). The monitor polls the record every
``--poll`` seconds, and at once when ``--wake-fd`` (the read end of a pipe whose write end only
the worker holds) reaches its end: the worker closes it right after its closing record, and a
worker that dies closes it too, so neither waits out a poll (the worker reaps the monitor on its
way out), and:

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
import json
import math
import mmap
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass

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
    # Not stalwart.atomic_file's write: this script imports nothing of stalwart (see above).
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _append_goodput_fault(path: str, rank: int, overrun: Overrun) -> None:
    """A ``fault`` record in the goodput ledger (``stalwart.observability.goodput.records``'s
    format): the next session splits its downtime into hang-until-detected and restart."""
    record = {
        "k": "fault",
        "t": round(time.time(), 6),
        "s": f"hang-monitor-rank{rank}",
        "cause": "hang",
        "rank": rank,
        "detail": f"{overrun.section} open {overrun.elapsed_s:.1f} s > {overrun.timeout_s:g} s",
    }
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        with open(path, "rb") as f:  # end a torn last line first, so this record stays readable
            torn = size > 0 and (f.seek(size - 1), f.read(1))[1] != b"\n"
        os.write(fd, (b"\n" if torn else b"") + (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _flight_recorder_dump(pipe: str | None, dump: str | None, wait_s: float) -> str:
    """Ask ProcessGroupNCCL's watchdog thread for a flight-recorder dump through its named pipe
    (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``); it writes ``dump`` (never read here: it is pickle)."""
    if not pipe or not os.path.exists(pipe):
        return "no NCCL flight recorder (not an NCCL job, or TORCH_NCCL_TRACE_BUFFER_SIZE=0)"
    before = os.path.getmtime(dump) if dump and os.path.exists(dump) else None
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"1\n")
        finally:
            os.close(fd)
    except OSError as exc:  # ENXIO: no reader (the process group is gone)
        return f"NCCL flight recorder pipe {pipe}: {exc}"
    deadline = time.monotonic() + wait_s
    while dump and time.monotonic() < deadline:
        if os.path.exists(dump) and os.path.getmtime(dump) != before:
            return f"NCCL flight recorder dumped to {dump} (read it with torchfrtrace)"
        time.sleep(0.05)
    return f"NCCL flight recorder asked through {pipe}; no dump in {wait_s:g} s"


def _abort_then_wait(args: argparse.Namespace, log: _Log) -> bool:
    """Hard tier: ask the worker to abort its process groups; True if it then exited itself.

    The worker answers ``D`` (aborted: give it ``--abort-grace`` to leave) or ``N`` (no process
    group: kill now); no answer within the grace (its GIL is held) also means kill."""
    if args.abort_fd < 0:
        return False
    try:
        os.write(args.abort_fd, b"A")
    except OSError:
        return not _worker_alive(args.pid, args.parent_pid)
    deadline = time.monotonic() + args.abort_grace
    answer = b""
    if args.abort_reply_fd >= 0:
        ready, _, _ = select.select([args.abort_reply_fd], [], [], args.abort_grace)
        answer = os.read(args.abort_reply_fd, 1) if ready else b""
    if answer == b"N":
        return False
    what = "aborted the worker's process groups" if answer == b"D" else "no answer to the abort"
    log.line(f"hard tier: {what} (peers blocked in a collective return with an error)")
    while time.monotonic() < deadline:
        if not _worker_alive(args.pid, args.parent_pid):
            return True
        time.sleep(0.05)
    return False


def handle_overrun(args: argparse.Namespace, log: _Log, overrun: Overrun) -> None:
    """Escalate in tiers: soft (goodput fault record, every thread's stack, the NCCL flight
    recorder), hard (abort the process groups), then kill. Never raises for a vanished worker."""
    detected = time.time()
    log.line(
        f"HANG: rank {args.rank} (pid {args.pid}) section '{overrun.section}' open for "
        f"{overrun.elapsed_s:.2f} s > timeout {overrun.timeout_s:.2f} s; soft tier: dumping "
        "stacks; then abort the process groups, then kill the worker (the launcher restarts it)"
    )
    if args.goodput_file:
        try:
            _append_goodput_fault(args.goodput_file, args.rank, overrun)
        except OSError as exc:
            log.line(f"could not append to {args.goodput_file}: {exc}")
    dump = _collect_stack_dump(args.pid, args.dump_signal, args.stack_file, args.dump_wait)
    log.line("stack dump (faulthandler, all threads):\n" + dump.rstrip())
    log.line(_flight_recorder_dump(args.nccl_pipe, args.nccl_dump, args.dump_wait))
    spy = _py_spy_dump(args.pid)
    if spy is not None:
        log.line("py-spy dump:\n" + spy.rstrip())
    exited = _abort_then_wait(args, log)
    if not exited:
        _kill(args.pid, args.term_grace)
        log.line(f"killed worker pid {args.pid} (rank {args.rank})")
    else:
        log.line(f"worker pid {args.pid} (rank {args.rank}) exited after the abort")
    if args.report_file:
        report: dict[str, object] = {
            "rank": args.rank,
            "pid": args.pid,
            "section": overrun.section,
            "elapsed_s": round(overrun.elapsed_s, 3),
            "timeout_s": overrun.timeout_s,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "detected": round(detected, 3),
            "tiers": ["soft", "hard", "exited" if exited else "kill"],
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
            _pause(args)
    finally:
        buf.close()


def _pause(args: argparse.Namespace) -> None:
    """Sleep ``--poll`` seconds, or until ``--wake-fd`` reaches its end (then no longer
    watched: a pipe at its end is always readable)."""
    if args.wake_fd < 0:
        time.sleep(args.poll)
        return
    ready, _, _ = select.select([args.wake_fd], [], [], args.poll)
    if ready and not os.read(args.wake_fd, 1):
        os.close(args.wake_fd)
        args.wake_fd = -1


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
    p.add_argument("--wake-fd", type=int, default=-1, help="poll at once when this pipe ends")
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
    p.add_argument("--goodput-file", default=None, help="the run's goodput.jsonl (fault record)")
    p.add_argument("--abort-fd", type=int, default=-1, help="pipe to the worker's abort listener")
    p.add_argument("--abort-reply-fd", type=int, default=-1, help="the listener's answer")
    p.add_argument(
        "--abort-grace", type=_positive, default=2.0, help="seconds to exit after the abort"
    )
    p.add_argument("--nccl-pipe", default=None, help="the flight recorder's named pipe")
    p.add_argument("--nccl-dump", default=None, help="where the flight recorder dumps")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return int(run_monitor(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
