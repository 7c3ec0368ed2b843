"""The hard tier of hang escalation: the hung rank's monitor aborts its process groups, and the
peer blocked in a collective returns with an error instead of waiting to be killed."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from stalwart.reliability.hang.abort_listener import ABORT, ABORTED, NOTHING_TO_ABORT, AbortListener

from dist_utils import run_distributed


def test_listener_runs_abort_once_on_request_and_not_on_close() -> None:
    calls: list[int] = []
    listener = AbortListener(lambda: calls.append(1) is None)
    os.write(listener.write_fd, ABORT)
    assert listener.aborted.wait(5.0)
    assert os.read(listener.reply_fd, 1) == ABORTED  # the monitor's answer: aborted
    listener.close()
    nothing = AbortListener(lambda: False)  # no process group: the monitor kills at once
    os.write(nothing.write_fd, ABORT)
    assert os.read(nothing.reply_fd, 1) == NOTHING_TO_ABORT
    nothing.close()
    quiet = AbortListener(lambda: calls.append(2) is None)
    quiet.close()
    quiet.close()  # idempotent
    assert calls == [1] and not quiet.aborted.is_set()


def _body(rank: int, world_size: int) -> tuple[str, float]:
    listener = AbortListener()
    started = time.monotonic()
    if rank == 1:  # hung outside any collective; its monitor requests the abort after 1 s
        threading.Timer(1.0, os.write, (listener.write_fd, ABORT)).start()
        time.sleep(4.0)
        return ("aborted" if listener.aborted.is_set() else "not aborted", 0.0)
    try:
        dist.all_reduce(torch.ones(1))
        return ("returned", time.monotonic() - started)
    except RuntimeError:
        return ("error", time.monotonic() - started)


@pytest.mark.distributed
def test_abort_of_the_hung_rank_releases_the_peer_waiting_in_a_collective() -> None:
    (peer, waited), (hung, _) = run_distributed(_body, world_size=2)
    assert hung == "aborted" and peer == "error"
    assert waited < 3.0  # released at the abort (~1 s), not when the hung rank ends (4 s)
