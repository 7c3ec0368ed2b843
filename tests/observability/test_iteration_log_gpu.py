"""Every iteration's row on a GPU: no synchronisation between log steps with the ring on, and
the rows of a CUDA-graph replay's static outputs are each iteration's own values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption, TimingMode
from stalwart.observability.train_log import LogConfig, TrainingLog

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _Sink:
    """A dashboard that keeps what it is given (host values only)."""

    def __init__(self) -> None:
        self.loss: dict[int, float] = {}

    def add_scalar(self, name: str, value: float, step: int) -> None: ...
    def add_text(self, name: str, text: str, step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        if "lm loss" in values:
            self.loss[step] = float(values["lm loss"])


def _log(tmp_path: Path, device: torch.device, sink: _Sink) -> TrainingLog:
    timers = Timers(0, TimingLogOption.MINMAX, mode=TimingMode.EVENTS, device=device)
    log = TrainingLog(
        LogConfig(log_interval=5, log_timestamp=False),
        train_iters=10,
        sink=sink,  # type: ignore[arg-type]
        timers=timers,
        rank=0,
        world_size=1,
        metrics_file=str(tmp_path / "metrics.jsonl"),
        print_fn=lambda line: None,
    )
    timers(INTERVAL_TIME).start()
    return log


def test_graph_replays_rows_without_a_sync_between_log_steps(tmp_path: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    w = torch.ones(64, device=device)
    step = torch.zeros((), device=device)
    loss, norm, skipped = (torch.zeros((), device=device) for _ in range(3))

    def body() -> None:  # a stand-in iteration: static outputs rewritten by every replay
        step.add_(1.0)
        loss.copy_((w * step).mean())
        norm.copy_(step * 0.5)
        skipped.copy_(step == 3.0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    step.zero_()
    sink = _Sink()
    log = _log(tmp_path, device, sink)
    for i in range(1, 11):
        graph.replay()
        if i % 5 not in (0, 1):  # between log steps (1 is the first line): no sync at all
            torch.cuda.set_sync_debug_mode("error")
        try:
            log.on_iteration(
                i,
                losses={"lm loss": loss},
                learning_rate=1e-3,
                global_batch_size=4,
                consumed_samples=4 * i,
                grad_norm=norm,
                skipped=skipped.bool(),
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    log.close()
    text = (tmp_path / "metrics.iterations.jsonl").read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 11))
    assert [r["loss"] for r in rows] == [float(i) for i in range(1, 11)]  # each its own
    assert [r["grad_norm"] for r in rows] == [i * 0.5 for i in range(1, 11)]
    assert [r["skipped"] for r in rows] == [i == 3 for i in range(1, 11)]
    times = [r.get("iteration_ms") for r in rows]
    assert times[0] is None and all(t is not None and t > 0 for t in times[1:])  # CUDA events
    assert sink.loss == {i: float(i) for i in range(1, 11)}  # the dashboards: every iteration
