"""The hard tier of hang escalation, worker side: abort the process groups when told to.

The hang monitor is another process; it cannot call into the worker. It writes one byte into a
pipe whose read end a daemon thread of the worker blocks on (a blocking ``read`` holds no GIL).
The thread then aborts every process group, so peers of a hung rank that wait in a collective
return with an error and leave through their normal error path (files closed, the goodput
ledger's last interval written) instead of waiting to be killed, and answers on a second pipe:
``D`` (aborted) or ``N`` (no process group: the monitor kills at once). A main thread that holds
the GIL forever (a hang in C code that never releases it) keeps the thread from running and
from answering: the next tier, the kill, covers that.

Usage (what ``MonitorClient`` does)::

    listener = AbortListener()                  # before the monitor process starts
    spawn_monitor(pass_fds=listener.monitor_fds, args=["--abort-fd", str(listener.write_fd),
                                                       "--abort-reply-fd", str(listener.reply_fd)])
    ...
    listener.close()                            # at shutdown
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

ABORT = b"A"
ABORTED = b"D"
NOTHING_TO_ABORT = b"N"
_STOP = b"S"


def abort_process_groups() -> bool:
    """Abort every process group (NCCL: kills pending kernels; gloo: closes its pairs).

    Returns whether there was a process group to abort.
    """
    if "torch.distributed" not in sys.modules:
        return False  # never imported: there is no process group (and no need to import torch)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    return True


class AbortListener:
    """A daemon thread that runs ``abort`` once when a byte ``A`` arrives on its pipe, and
    answers ``D`` (``abort`` returned True) or ``N`` on the reply pipe."""

    def __init__(self, abort: Callable[[], bool] = abort_process_groups) -> None:
        self._abort = abort
        self._read_fd, self.write_fd = os.pipe()
        self.reply_fd, self._reply_write_fd = os.pipe()
        self.aborted = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-abort", daemon=True)
        self._thread.start()

    @property
    def monitor_fds(self) -> tuple[int, int]:
        """The ends the monitor process gets (``pass_fds``): request write, reply read."""
        return self.write_fd, self.reply_fd

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
            did = self._abort()
        except Exception as exc:  # the kill tier follows anyway
            logger.error("hang watchdog: abort failed: %s", exc)
            did = False
        with contextlib.suppress(OSError):
            os.write(self._reply_write_fd, ABORTED if did else NOTHING_TO_ABORT)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread and close every end (idempotent)."""
        if self.write_fd < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self.write_fd, _STOP)
        self._thread.join(timeout_s)
        for fd in (self._read_fd, self.write_fd, self.reply_fd, self._reply_write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read_fd = self.write_fd = self.reply_fd = self._reply_write_fd = -1
