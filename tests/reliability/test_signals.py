"""Exit-signal parsing and the flag-only handler."""

from __future__ import annotations

import os
import pickle
import signal

import pytest

from stalwart.reliability.signals import (
    DataLoaderWorkerSignalGuard,
    DistributedSignalHandler,
    parse_exit_signal,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("SIGTERM", signal.SIGTERM), ("sigint", signal.SIGINT), ("USR1", signal.SIGUSR1),
     (" SIGUSR2 ", signal.SIGUSR2), (signal.SIGHUP, signal.SIGHUP)],
)  # fmt: skip
def test_parse_exit_signal(text: str | signal.Signals, expected: signal.Signals) -> None:
    assert parse_exit_signal(text) is expected


@pytest.mark.parametrize("text", ["SIGKILL", "SIGFOO", "", "15", signal.SIGSEGV])
def test_parse_exit_signal_rejects_naming_flag_and_allowed(text: str | signal.Signals) -> None:
    with pytest.raises(ValueError, match="--exit-signal") as info:
        parse_exit_signal(text)
    assert "SIGTERM, SIGINT, SIGUSR1, SIGUSR2" in str(info.value)


def test_handler_only_sets_flag_and_restores_previous() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        assert not handler.received
        os.kill(os.getpid(), signal.SIGUSR1)  # the process must survive: only a flag is set
        assert handler.received
        assert handler.signals_received()  # no process group: the local flag
    assert signal.getsignal(signal.SIGUSR1) is before
    assert handler.release() is False  # restored once only


def test_handler_ignores_signal_in_other_process() -> None:
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        handler._owner_pid = os.getpid() + 1  # as seen from a forked child that inherited it
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not handler.received


def test_worker_guard_ignores_exit_signal_and_chains() -> None:
    seen: list[int] = []
    guard = DataLoaderWorkerSignalGuard(["SIGUSR2"], inner=seen.append)
    before = signal.getsignal(signal.SIGUSR2)
    try:
        guard(3)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)  # ignored: the process survives
        assert seen == [3]
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert pickle.loads(pickle.dumps(DataLoaderWorkerSignalGuard())).signals == (signal.SIGTERM,)
