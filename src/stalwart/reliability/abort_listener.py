"""The hard tier of hang escalation, worker side: abort the process groups when told to.

The hang monitor is another process; it cannot call into the worker. It writes one byte into a
pipe whose read end a daemon thread of the worker blocks on (a blocking ``read`` holds no GIL).
The thread then aborts every process group: peers of a hung rank that wait in a collective
return with an error and leave through their normal error path (files closed, the goodput
ledger's last interval written) instead of waiting to be killed. A main thread that holds the
GIL forever (a hang in C code that never releases it) keeps the thread from running: the next
tier, the kill, covers that.

Usage (what ``SectionMonitor`` does)::

    listener = AbortListener()                  # before the monitor process starts
    spawn_monitor(pass_fds=(listener.write_fd,), args=["--abort-fd", str(listener.write_fd)])
    ...
    listener.close()                            # at shutdown
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

ABORT = b"A"
_STOP = b"S"


def abort_process_groups() -> None:
    """Abort every process group (NCCL: kills pending kernels; gloo: closes its pairs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
            return
        dist.destroy_process_group()


class AbortListener:
    """A daemon thread that runs ``abort`` once when a byte ``A`` arrives on its pipe."""

    def __init__(self, abort: Callable[[], None] = abort_process_groups) -> None:
        self._abort = abort
        self._read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)  # handed to the monitor with pass_fds
        self.aborted = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-abort", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            message = os.read(self._read_fd, 1)
        except OSError:
            return
        if message != ABORT:
            return
        logger.error("hang watchdog: aborting the process groups (hard tier)")
        self.aborted.set()
        try:
            self._abort()
        except Exception as exc:  # the kill tier follows anyway
            logger.error("hang watchdog: abort failed: %s", exc)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread and close both ends (idempotent)."""
        if self.write_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.write_fd, _STOP)
            self._thread.join(timeout_s)
            for fd in (self._read_fd, self.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._read_fd = self.write_fd = -1
