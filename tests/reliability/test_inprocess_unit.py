"""In-process restart without processes: retry policy, store records, monitor, single-rank wrapper."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.inprocess.config import InProcessConfig
from stalwart.reliability.inprocess.health import (
    HealthCheckFailed,
    check_device_computes,
    run_health_checks,
)
from stalwart.reliability.inprocess.monitor import AttemptMonitor, MonitorTimes
from stalwart.reliability.inprocess.policy import (
    EXIT_CODE_INPROCESS_GAVE_UP,
    FailureKind,
    FailureRecord,
    Verdict,
    decide_retry,
)
from stalwart.reliability.inprocess.store import RestartStore
from stalwart.reliability.inprocess.wrapper import (
    Attempt,
    InProcessRestarter,
    InProcessRestartExhausted,
    RestartOptions,
    unhealthy_peers,
)


def _rec(attempt: int, iteration: int | None = 5, message: str = "boom", **kw) -> FailureRecord:
    fields = {"rank": 1, "kind": FailureKind.EXCEPTION, "error_type": "RuntimeError"} | kw
    return FailureRecord(attempt=attempt, iteration=iteration, message=message, **fields)


def test_decide_retry_bounds_attempts_and_repeated_faults() -> None:
    assert decide_retry([_rec(0)], max_iterations=3) is Verdict.RETRY
    # Same type, message and iteration twice: a repeatable fault (e.g. OOM) stops at once.
    assert decide_retry([_rec(0), _rec(1)], 5) is Verdict.STOP_REPEATED_FAULT
    # Different faults: the attempt limit (the first run counts) stops them.
    assert decide_retry([_rec(0, 5), _rec(1, 7)], 3) is Verdict.RETRY
    assert decide_retry([_rec(0, 5), _rec(1, 7), _rec(2, 9)], 3) is Verdict.STOP_ATTEMPT_LIMIT
    assert decide_retry([_rec(0, kind=FailureKind.FATAL)], 3) is Verdict.STOP_FATAL


def test_failure_record_round_trip_and_first_writer_wins() -> None:
    store = RestartStore.local()
    first = store.publish_failure(_rec(0, message="first"))
    second = store.publish_failure(_rec(0, message="second", rank=0))
    assert first == second == store.failure(0)
    assert second.message == "first" and second.kind is FailureKind.EXCEPTION
    assert store.failure(1) is None
    assert store.history(1) == [first]


def test_config_validation_names_flags() -> None:
    with pytest.raises(ValueError, match="--inprocess-granularity"):
        InProcessConfig(inprocess_granularity="rack")
    opts = RestartOptions.from_config(InProcessConfig(inprocess_max_iterations=5))
    assert opts.max_iterations == 5 and opts.monitor_times().heartbeat_timeout == 60.0


def _monitor(store: RestartStore, **times: float) -> AttemptMonitor:
    base = {"soft_timeout": 10.0, "hard_timeout": 20.0, "heartbeat_interval": 1.0}
    base.update(times)
    killed: list[bool] = []
    monitor = AttemptMonitor(
        store,
        0,
        MonitorTimes(heartbeat_timeout=base["soft_timeout"], **base),
        main_thread_id=1,  # no such thread: interrupts go nowhere
        on_hard_timeout=lambda: killed.append(True),
    )
    monitor.killed = killed  # type: ignore[attr-defined]
    return monitor


def test_watchdog_soft_timeout_publishes_and_hard_timeout_kills() -> None:
    store = RestartStore.local()
    monitor = _monitor(store)
    iteration = [3]
    monitor.probe = lambda: iteration[0]
    monitor._running = True  # as after start(), without the thread
    monitor.reset(0.0)
    monitor.tick(5.0)
    iteration[0] = 4  # progress resets the clock
    monitor.tick(9.0)
    monitor.tick(18.0)
    assert store.failure(0) is None
    monitor.tick(19.5)
    record = store.failure(0)
    assert record is not None and record.kind is FailureKind.WATCHDOG and record.iteration == 5
    assert not monitor.killed  # type: ignore[attr-defined]
    monitor.tick(29.5)
    assert monitor.killed == [True]  # type: ignore[attr-defined]


def test_dead_peer_is_detected_by_heartbeat() -> None:
    store = RestartStore(None, 0, 2, _store=dist.HashStore())
    monitor = _monitor(store, soft_timeout=3.0, hard_timeout=100.0)
    monitor.probe = lambda: None
    monitor.reset(0.0)
    for t in (0.0, 1.0, 2.0, 3.0):
        monitor.tick(t)
    assert store.failure(0) is None
    monitor.tick(4.0)
    record = store.failure(0)
    assert record is not None and record.kind is FailureKind.DEAD_RANK and record.rank == 1


def _restarter(**options: object) -> tuple[InProcessRestarter, list[str]]:
    said: list[str] = []
    opts = RestartOptions(heartbeat_interval=0.05, **options)  # type: ignore[arg-type]
    restarter = InProcessRestarter(
        opts, lambda store: DistributedContext(), store=RestartStore.local(), say=said.append
    )
    return restarter, said


def test_single_rank_restarts_then_succeeds() -> None:
    restarter, said = _restarter()

    def train(attempt: Attempt) -> str:
        attempt.set_progress(lambda: 6)
        if attempt.index == 0:
            raise RuntimeError("injected")
        return f"done in attempt {attempt.index}"

    assert restarter.run(train) == "done in attempt 1"
    assert any("attempt 1: rank 0 failed at iteration 7: RuntimeError: injected" in s for s in said)
    assert len(restarter.memory) == 1


def test_peer_failure_interrupts_the_main_thread() -> None:
    restarter, said = _restarter()

    def train(attempt: Attempt) -> int:
        if attempt.index == 0:
            restarter.store.publish_failure(_rec(0, message="peer died", iteration=2))
            restarter.store.attempt(0).set("released_1", "1")  # the failed peer freed its groups
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # pure Python: interruptible
                time.sleep(0.01)
            raise AssertionError("the monitor did not interrupt the main thread")
        return attempt.index

    assert restarter.run(train) == 1
    assert any("rank 1 failed at iteration 2: RuntimeError: peer died" in s for s in said)


def test_repeatable_fault_gives_up_with_exit_code() -> None:
    restarter, said = _restarter(max_iterations=5)

    def train(attempt: Attempt) -> None:
        attempt.set_progress(lambda: 4)
        raise MemoryError("CUDA out of memory")

    with pytest.raises(InProcessRestartExhausted) as info:
        restarter.run(train)
    assert info.value.exit_code == EXIT_CODE_INPROCESS_GAVE_UP
    assert info.value.verdict is Verdict.STOP_REPEATED_FAULT
    assert "the same fault happened twice" in said[-1]
    assert len(restarter.failures) == 2


def test_no_retry_exceptions_propagate_unchanged() -> None:
    restarter, _ = _restarter(no_retry=(ValueError,))

    def train(attempt: Attempt) -> None:
        raise ValueError("--clip-grad must be > 0")

    with pytest.raises(ValueError, match="--clip-grad"):
        restarter.run(train)


def test_health_checks_report_failures_and_node_peers() -> None:
    def broken(device: object) -> None:
        raise HealthCheckFailed("wrong matmul")

    cpu = torch.device("cpu")
    assert run_health_checks([check_device_computes], cpu) is None
    assert "wrong matmul" in (run_health_checks([broken], cpu) or "")
    assert unhealthy_peers(["ok a", "bad b", None]) == {1: "b"}


def test_pre_abort_callbacks_run_newest_first_before_the_abort(monkeypatch) -> None:
    from stalwart.reliability.inprocess import wrapper

    order: list[str] = []
    monkeypatch.setattr(wrapper, "abort_process_groups", lambda: order.append("abort"))

    def failing() -> None:
        order.append("failing")
        raise RuntimeError("a callback error must not stop the abort")

    callbacks = [lambda: order.append("graphs"), failing]
    wrapper.release_then_abort(callbacks)
    assert order == ["failing", "graphs", "abort"]
