"""One job per checkpoint directory: a lock file held by rank 0 for the job's life.

``<dir>/.stalwart.lock`` is a small JSON record ``{"host", "pid", "boot", "pidns", "job",
"token", "since", "heartbeat"}`` (``boot``: the host's boot id, ``pidns``: the holder's PID
namespace, both None off Linux). It is created atomically (written under a temporary name,
then ``os.link``: the link fails when the file exists, also on NFS) and refreshed every
``heartbeat_s`` seconds by a daemon thread. A lock that is present is judged (`LockVerdict`):

* this process's own (same host, boot, PID namespace and pid): an in-process restart
  rebuilds its components; taken at once;
* stale: its heartbeat is older than ``stale_s``, or it has no readable heartbeat, or its
  holder is provably dead (same host, boot and PID namespace, and that pid is gone or a
  zombie): taken over at once;
* held: a fresh heartbeat from a live pid of this host's namespace; refused at once, the same
  job included (a second SLURM step while the first still runs);
* doubtful: the heartbeat is fresh, but its pid cannot be checked here (another PID namespace
  or container with the same host name: its pid means nothing here) or it comes from another
  host as the same job (``$STALWART_JOB_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID``,
  its default ``none`` excluded, else ``$SLURM_JOB_ID``: a relaunch, or a second step of that
  job still running). Acquire then watches the record: if it changes (the holder beats), the
  holder is alive and the lock is refused; if it stays unchanged until it is ``stale_s`` old
  (by this host's clock, and never longer than ``stale_s`` of watching), it is taken over.
  A fresh heartbeat always wins over a PID check or a job id;
* held, too: a fresh heartbeat from another host and another job; refused at once.

A relaunch of the same job gets the lock at once when the previous attempt exited in any
way that runs Python's exit handlers (the manager releases on ``close``, an ``atexit`` hook on
other exits), or was killed on the same host and namespace; after a ``SIGKILL`` elsewhere it
waits at most ``stale_s`` (default 60 s).

A refusal raises ``ValueError`` in one line naming the holder (host, pid, since) and the lock
file. A lock taken over is first renamed aside and checked to be the record judged, so two
jobs racing for one stale lock cannot both win. The heartbeat thread checks that the file is
still its own before each refresh; a lock lost to another job (this one froze past
``stale_s``) is reported by :meth:`check_held`, which the checkpoint manager calls before it
deletes or writes anything. A lock file that is a symbolic link is refused (stalwart never
makes one). The release survives any ``OSError`` (a read-only or immutable directory): the
lock then expires ``stale_s`` after its last heartbeat.

Example::

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> lock = SaveDirLock(d, flag="--save")
    >>> lock.acquire()
    >>> lock.check_held()
    >>> lock.release()
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import json
import logging
import os
import socket
import threading
import time
from typing import Any, cast

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.checkpoint.errors import CheckpointError
from stalwart.regular_file import open_regular

logger = logging.getLogger("stalwart.checkpoint")

LOCK_FILENAME = ".stalwart.lock"
JOB_ID_ENV = "STALWART_JOB_ID"
DEFAULT_HEARTBEAT_S = 10.0
DEFAULT_STALE_S = 60.0


def current_job_id() -> str | None:
    """This job's identity across restarts, or None when the launcher gives none."""
    for name in (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "").strip()
        if value and value != "none":  # torchrun's default --rdzv-id is the literal "none"
            return f"{name}={value}"
    return None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process of this host. A zombie is not: a killed job's
    process whose parent has not reaped it (its launcher was killed too, and the init that
    inherited it reaps late, or never in some containers) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no procfs (not Linux), or it just went away
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")".
    end = stat.rfind(b")")
    return end >= 0 and stat[end + 2 : end + 3] == b"Z"


class LockVerdict(enum.Enum):
    """What a lock record found in the directory means for this process (module docstring)."""

    MINE = "this process's own"
    STALE = "stale"
    DOUBTFUL = "fresh, holder maybe dead"
    HELD = "held by a live job"


def _process_identity() -> dict[str, str | None]:
    """This host's boot id and this process's PID namespace: with the host name they say
    whether a recorded pid means a process here (None where /proc does not tell)."""
    boot: str | None = None
    pidns: str | None = None
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id", "rb") as f:
        boot = f.read(64).decode("ascii", "replace").strip() or None
    with contextlib.suppress(OSError):
        pidns = os.readlink("/proc/self/ns/pid")
    return {"boot": boot, "pidns": pidns}


def describe_holder(record: dict[str, Any]) -> str:
    since = record.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, (int, float))
        else "?"
    )
    job = f", {record['job']}" if record.get("job") else ""
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}{job}, since {when}"


class SaveDirLock:
    """The lock of one checkpoint directory (see module docstring). Use on one rank only."""

    def __init__(
        self,
        directory: str,
        *,
        flag: str,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        stale_s: float = DEFAULT_STALE_S,
        job_id: str | None = None,
    ) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILENAME)
        self._flag = flag
        self._heartbeat_s = heartbeat_s
        self._stale_s = stale_s
        self._job = job_id if job_id is not None else current_job_id()
        self._host = socket.gethostname()
        self._identity = _process_identity()
        self._token = f"{self._host}-{os.getpid()}-{os.urandom(6).hex()}"
        self._since = time.time()
        self._held = False
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ records
    def _record(self) -> dict[str, Any]:
        return {
            "host": self._host,
            "pid": os.getpid(),
            **self._identity,
            "job": self._job,
            "token": self._token,
            "since": self._since,
            "heartbeat": time.time(),
        }

    def _read(self, path: str | None = None) -> dict[str, Any] | None:
        """The record at ``path`` (default: the lock); None when absent; {} when unreadable."""
        try:
            with open_regular(path or self.path) as f:
                record = json.loads(f.read(1 << 16))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _write_tmp(self) -> str:
        tmp = f"{self.path}.{self._token}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _same_namespace(self, record: dict[str, Any]) -> bool:
        """Whether the record's pid names a process of this host's boot and PID namespace."""
        return record.get("host") == self._host and all(
            record.get(key) == value for key, value in self._identity.items()
        )

    def _age(self, record: dict[str, Any]) -> float | None:
        beat = record.get("heartbeat")
        if not isinstance(beat, (int, float)) or isinstance(beat, bool):
            return None
        return time.time() - beat

    def judge(self, record: dict[str, Any]) -> LockVerdict:
        """The verdict on a lock record found in the directory (pure but for the pid check)."""
        pid = record.get("pid")
        same_ns = self._same_namespace(record) and isinstance(pid, int)
        if same_ns and pid == os.getpid():
            return LockVerdict.MINE
        age = self._age(record)
        if age is None or age > self._stale_s:
            return LockVerdict.STALE  # unreadable, torn or old: nobody is refreshing it
        if same_ns:  # that pid is this namespace's: the check is sound
            return LockVerdict.HELD if _pid_alive(cast(int, pid)) else LockVerdict.STALE
        same_job = self._job is not None and record.get("job") == self._job
        if same_job or record.get("host") == self._host:
            return LockVerdict.DOUBTFUL  # a relaunch, or a pid we cannot check: watch the beat
        return LockVerdict.HELD

    def _watch(self, record: dict[str, Any]) -> tuple[dict[str, Any] | None, LockVerdict]:
        """Watch a doubtful record until it changes (its holder is alive: HELD), goes away
        (None) or ages past ``stale_s`` unchanged (STALE). Blocks at most ``stale_s``."""
        age = min(max(self._age(record) or 0.0, 0.0), self._stale_s)
        wait = self._stale_s - age + min(self._heartbeat_s, 1.0)
        logger.warning(
            "the lock of %s is held by %s with a fresh heartbeat (%.0f s old); waiting up to "
            "%.0f s for it to go stale",
            self.directory,
            describe_holder(record),
            age,
            wait,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(0.5, self._heartbeat_s / 2))
            now = self._read()
            if now != record:
                return now, (LockVerdict.HELD if now else LockVerdict.STALE)
        return record, LockVerdict.STALE

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> None:
        """Take the lock (creating the directory) and start the heartbeat.

        Raises:
            ValueError: another live job holds it (one line naming the holder and the file).
            OSError: the directory cannot be written.
        """
        if self._held:
            return
        os.makedirs(self.directory, exist_ok=True)
        if os.path.islink(self.path):
            raise ValueError(
                f"{self._flag} {self.directory}: the lock file {self.path} is a symbolic link "
                "(stalwart never makes one): remove it"
            )
        for _ in range(5):
            if self._try_create():
                break
            holder = self._read()
            verdict = self.judge(holder) if holder else LockVerdict.STALE
            if holder and verdict is LockVerdict.DOUBTFUL:
                holder, verdict = self._watch(holder)
            if holder is None:
                continue  # released between our attempt and the read
            if verdict is LockVerdict.HELD:
                raise ValueError(
                    f"{self._flag} {self.directory} is in use by another job "
                    f"({describe_holder(holder)}; "
                    f"lock file {self.path}); use another directory, or wait for that job to end "
                    f"(a killed job's lock expires {self._stale_s:.0f} s after its last heartbeat)"
                )
            if verdict is LockVerdict.STALE and holder:
                logger.warning(
                    "taking over the stale lock of %s (%s)", self.directory, describe_holder(holder)
                )
            self._break(holder)
        else:
            raise ValueError(f"{self._flag} {self.directory}: could not take the lock {self.path}")
        self._held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="stalwart-save-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)  # a normal interpreter exit after an exception releases it

    def _try_create(self) -> bool:
        tmp = self._write_tmp()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _break(self, judged: dict[str, Any]) -> None:
        """Remove a lock judged stale or ours; put it back if it changed meanwhile."""
        aside = f"{self.path}.{self._token}.broken"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._read(aside) != judged:  # someone else took it over meanwhile: restore theirs
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            os.unlink(aside)

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            record = self._read()
            if record is None or record.get("token") != self._token:
                self._lost = describe_holder(record) if record else "the lock file was removed"
                logger.error("lost the lock of %s: %s", self.directory, self._lost)
                return
            try:
                write_text_atomic(self.path, json.dumps(self._record()), sync=Sync.FILE)
            except OSError as exc:  # a full disk must not kill the job; the next beat retries
                logger.warning("could not refresh the lock %s: %s", self.path, exc)

    def check_held(self) -> None:
        """Raise ``CheckpointError`` when this job lost the lock to another one."""
        if self._lost is not None:
            raise CheckpointError(
                f"{self._flag} {self.directory}: this job lost its lock ({self._lost}); "
                "not writing or deleting checkpoints there"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it is still ours (idempotent)."""
        if not self._held:
            return
        self._held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.release)
        record = self._read()
        if record is not None and record.get("token") == self._token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # read-only or immutable now: the next job sees a stale lock
                logger.warning(
                    "could not remove the lock %s (%s); it expires %.0f s after its last heartbeat",
                    self.path,
                    exc.strerror or exc,
                    self._stale_s,
                )


class SaveDirLocks:
    """The locks of one job's save roots (``--save``, an explicit ``--non-persistent-ckpt-dir``),
    taken and released together on rank 0."""

    def __init__(self, roots: list[tuple[str | None, str]], job_id: str | None = None) -> None:
        self._roots = [(root, flag) for root, flag in roots if root is not None]
        self._job_id = job_id
        self.locks: list[SaveDirLock] = []

    def acquire(self) -> str | None:
        """Hold every root's lock (idempotent); the one-line refusal, else None."""
        held = {lock.directory for lock in self.locks}
        for root, flag in self._roots:
            if root in held:
                continue
            lock = SaveDirLock(root, flag=flag, job_id=self._job_id)
            try:
                lock.acquire()
            except (ValueError, OSError) as exc:
                return str(exc)
            self.locks.append(lock)
        return None

    def check_held(self) -> None:
        """``CheckpointError`` when another job took one of them over."""
        for lock in self.locks:
            lock.check_held()

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []
