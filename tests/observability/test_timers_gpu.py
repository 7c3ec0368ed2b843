"""CUDA-only checks: EVENTS timers and the training log never synchronise on the hot path."""

from __future__ import annotations

import time

import pytest
import torch

from stalwart.observability.sinks import NullSink
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timer, Timers, TimingLogOption, TimingMode
from stalwart.observability.train_log import LogConfig, TrainingLog

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _work(x: torch.Tensor, n: int = 20) -> torch.Tensor:
    for _ in range(n):
        x = x @ x
        x = x / x.norm()
    return x


def test_events_timer_does_not_block_and_measures_device_time() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(2048, 2048, device=device)
    timers = Timers(0, TimingLogOption.MAX, mode=TimingMode.EVENTS, device=device)
    t = timers("fb")
    assert isinstance(t, Timer)
    _work(x)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            t.start()
            _work(x)
            t.stop()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    events_s = t.elapsed()
    ref = Timers(0, TimingLogOption.MAX, mode=TimingMode.SYNC, device=device)("fb")
    for _ in range(3):
        ref.start()
        _work(x)
        ref.stop()
    sync_s = ref.elapsed()
    assert events_s > 0.0
    assert 0.5 * sync_s <= events_s <= 1.5 * sync_s + 0.005


def test_events_timer_host_sleep() -> None:
    t = Timers(0, TimingLogOption.MAX, mode=TimingMode.EVENTS)("idle")
    t.start()
    time.sleep(0.05)
    t.stop()
    assert 0.04 <= t.elapsed() < 0.5


def test_training_log_non_log_iterations_do_not_sync() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    losses = [torch.tensor(float(i), device=device) for i in range(1, 7)]
    skips = [torch.tensor(i == 2, device=device) for i in range(1, 7)]
    norm = torch.tensor(1.25, device=device)
    lines: list[str] = []
    timers = Timers(0, TimingLogOption.MINMAX, mode=TimingMode.EVENTS, device=device)
    log = TrainingLog(
        LogConfig(
            log_interval=5,
            tensorboard_log_interval=1000,
            log_timestamp=False,
            log_format="megatron",
        ),
        train_iters=6,
        sink=NullSink(),
        timers=timers,
        rank=0,
        world_size=1,
        print_fn=lines.append,
    )
    timers(INTERVAL_TIME).start()
    log.on_iteration(
        1,
        losses={"lm loss": losses[0]},
        learning_rate=0.1,
        global_batch_size=2,
        consumed_samples=2,
        grad_norm=norm,
        skipped=skips[0],
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for i in range(2, 5):  # neither log nor sink steps: must not sync
        log.on_iteration(
            i,
            losses={"lm loss": losses[i - 1]},
            learning_rate=0.1,
            global_batch_size=2,
            consumed_samples=2 * i,
            grad_norm=norm,
            skipped=skips[i - 1],
        )
    torch.cuda.set_sync_debug_mode("default")
    log.on_iteration(
        5,
        losses={"lm loss": losses[4]},
        learning_rate=0.1,
        global_batch_size=2,
        consumed_samples=10,
        grad_norm=norm,
        skipped=skips[4],
    )
    assert len(lines) == 2
    assert "| lm loss: 4.000000E+00 |" in lines[1]  # (3 + 4 + 5) / 3; iteration 2 was skipped
    assert "| number of skipped iterations:   1 |" in lines[1]
