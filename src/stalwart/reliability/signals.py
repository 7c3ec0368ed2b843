"""Exit-signal handling that only raises a flag, agreed across ranks at the step boundary.

The handler installed by `DistributedSignalHandler` does nothing but set a boolean: no I/O, no
collectives, no exceptions inside a signal handler (which could land in the middle of an NCCL
call or a checkpoint write). The training loop reads the flag once per iteration and all ranks
agree on it in one collective (`stalwart.reliability.exit.gather_exit_inputs`, or
`DistributedSignalHandler.signals_received`), so every rank saves and exits at the same iteration.

torchrun (torchelastic) sends SIGTERM to the workers and SIGKILL 30 s later, and that window is
shared by all ranks on the node: the save after a signal must finish well within it (the trainer
saves right after the step in which the flag was agreed; keep that save fast, e.g. async staging
plus a blocking finalize, or a local/non-persistent tier).

Data-loader workers: a forked worker inherits this process's Python signal handlers, and a
scheduler (``scancel``) signals *every* process of the job. Pass `DataLoaderWorkerSignalGuard` as
the DataLoader's ``worker_init_fn`` so workers *ignore* the exit signal: they keep serving batches
while the main process finishes the step and saves, and they exit through the DataLoader's normal
shutdown (or when the main process dies). The handler additionally checks the pid it was installed
in, so a worker that did not run the guard can never set the main process's flag.

Ctrl-C: with ``interrupt=True`` the handler also takes SIGINT (the trainer turns it on by default
for a single-process run attached to a terminal, `interrupt_handling_default`). The first Ctrl-C
only sets the flag, like the exit signal: the job saves and exits 130 with one line. A second
Ctrl-C at least a second later is the user insisting: it raises ``KeyboardInterrupt`` at once
(without saving). The handler records which signal arrived first (`received_signal`), so the exit
decision can tell a Ctrl-C (exit 130) from the scheduler's exit signal (exit 0).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any, TextIO

EXIT_SIGNAL_NAMES: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
# A second Ctrl-C sooner than this after the first is the same key press (a terminal and a
# launcher can both deliver it); later, it means "stop now".
INTERRUPT_ESCALATION_S = 1.0


def interrupt_handling_default(
    environ: Mapping[str, str], stdin: TextIO | None, stdout: TextIO | None
) -> bool:
    """Whether Ctrl-C should save-and-exit by default: one process (``WORLD_SIZE`` unset or 1,
    the same answer on every rank of a job) whose stdin and stdout are terminals."""

    def tty(stream: TextIO | None) -> bool:
        isatty = getattr(stream, "isatty", None)
        try:
            return bool(isatty()) if callable(isatty) else False
        except ValueError:  # a closed stream
            return False

    return environ.get("WORLD_SIZE", "1") == "1" and tty(stdin) and tty(stdout)


def parse_exit_signal(name: str | signal.Signals) -> signal.Signals:
    """``--exit-signal`` value (``"SIGTERM"``, ``"term"``, ``signal.SIGUSR1``) -> `signal.Signals`.

    Raises ValueError naming ``--exit-signal`` and the allowed names for anything else.
    """
    if isinstance(name, signal.Signals):
        text = name.name
    else:
        text = str(name).strip().upper()
        if text and not text.startswith("SIG"):
            text = "SIG" + text
    if text not in EXIT_SIGNAL_NAMES:
        raise ValueError(
            f"--exit-signal: {name!r} is not supported; choose one of "
            f"{', '.join(EXIT_SIGNAL_NAMES)}"
        )
    return signal.Signals[text]


class DistributedSignalHandler:
    """Context manager: while active, ``sig`` (and SIGINT with ``interrupt``) only sets a flag in
    the installing process.

    ``__enter__`` clears the flag, remembers the previous handlers and installs the flag handler;
    ``__exit__`` (or `release`) restores the previous handlers exactly once. Must be entered in
    the main thread (a Python rule for ``signal.signal``).

    Args:
        sig: the exit signal (``--exit-signal``).
        interrupt: also handle SIGINT (Ctrl-C); see the module docstring for a second Ctrl-C.
        clock: monotonic clock (tests).
    """

    def __init__(
        self,
        sig: signal.Signals = signal.SIGTERM,
        *,
        interrupt: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sig = parse_exit_signal(sig)
        handled = [self.sig]
        if interrupt and signal.SIGINT not in handled:
            handled.append(signal.SIGINT)
        self.signals: tuple[signal.Signals, ...] = tuple(handled)
        self.interrupt = interrupt
        self._clock = clock
        self._received: signal.Signals | None = None
        self._interrupted_at: float | None = None
        self._owner_pid = -1
        self._previous: dict[signal.Signals, _Handler] = {}
        self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only the process that installed the handler records the signal; a forked data-loader
        # worker that inherited it does nothing (it must not swallow the main process's exit).
        if os.getpid() != self._owner_pid:
            return
        sig = signal.Signals(signum)
        if sig is signal.SIGINT and self.interrupt and sig is not self.sig:
            now = self._clock()
            if self._interrupted_at is not None:
                if now - self._interrupted_at >= INTERRUPT_ESCALATION_S:
                    # The user pressed Ctrl-C again: stop now, without the save.
                    raise KeyboardInterrupt
                return
            self._interrupted_at = now
        if self._received is None:
            self._received = sig

    def __enter__(self) -> DistributedSignalHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("DistributedSignalHandler must be installed from the main thread")
        self._received = None
        self._interrupted_at = None
        self._owner_pid = os.getpid()
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> bool:
        """Restore the previous handlers; True the first time, False afterwards."""
        if not self._installed:
            return False
        for sig in self.signals:
            previous = self._previous.get(sig)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        self._installed = False
        return True

    @property
    def received(self) -> bool:
        """This rank's own flag (no communication)."""
        return self._received is not None

    @property
    def received_signal(self) -> signal.Signals | None:
        """The first handled signal that arrived on this rank (None: none yet)."""
        return self._received

    def signals_received(self, group: Any = None) -> bool:
        """True on every rank if any rank received the signal: one all-reduce (deliberate sync).

        The trainer normally folds the flag into `exit.gather_exit_inputs` instead, so that the
        signal and the time budget cost one collective together.
        """
        from stalwart.distributed.collectives import all_reduce_any

        return all_reduce_any([self.received], group)[0]


class DataLoaderWorkerSignalGuard:
    """``worker_init_fn`` that makes data-loader workers ignore the exit signal(s).

    Picklable (works with the spawn and forkserver start methods). ``inner`` is an optional
    ``worker_init_fn(worker_id)`` to chain, called after the signals are set.
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals | str] = (signal.SIGTERM,),
        inner: Callable[[int], None] | None = None,
    ) -> None:
        self.signals = tuple(parse_exit_signal(s) for s in signals)
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)
