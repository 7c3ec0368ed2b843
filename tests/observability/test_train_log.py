from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.observability.progress import ProgressBar
from stalwart.observability.sinks import NullSink
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption
from stalwart.observability.train_log import (
    IntervalInfo,
    LogConfig,
    LogField,
    TrainingLog,
    format_validation_lines,
)

GBS = 8
# (lm loss, skipped) per 1-based iteration; skipped given as a device tensor from it 4 on.
SEQUENCE: list[tuple[float, bool | torch.Tensor]] = [
    (2.0, False),
    (1.0, False),
    (4.0, False),
    (float("nan"), torch.tensor(True)),
    (3.0, False),
    (5.0, torch.tensor(False)),
    (-1.0, False),
]


class RecSink(NullSink):
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        self.calls.extend((k, float(v), step) for k, v in values.items())

    def add_scalar(self, name, value, step):  # type: ignore[no-untyped-def]
        self.calls.append((name, float(value), step))

    def series(self, key: str) -> dict[int, float]:
        return {s: v for k, v, s in self.calls if k == key}


class Straggler:
    """A provider as another engineer would write one."""

    def __init__(self) -> None:
        self.infos: list[IntervalInfo] = []

    def log_fields(self, info: IntervalInfo) -> Sequence[LogField]:
        self.infos.append(info)
        return [LogField("min/max step (ms)", 1.5, "{:.2f}", key="straggler-ms")]


def make_log(
    lines: list[str],
    tmp_path: Path | None = None,
    sink: Any = None,
    rank: int = 0,
    **cfg: Any,
) -> tuple[TrainingLog, Timers]:
    timers = Timers(
        0, TimingLogOption.MINMAX, device=torch.device("cpu")
    )  # CPU: no cuda.synchronize
    config = LogConfig(
        **{"log_interval": 3, "log_timestamp": False, "log_format": "megatron", **cfg}
    )
    log = TrainingLog(
        config,
        train_iters=10,
        sink=sink if sink is not None else NullSink(),
        timers=timers,
        rank=rank,
        world_size=1,
        metrics_file=str(tmp_path / "metrics.jsonl") if tmp_path is not None else None,
        extra_providers=[Straggler()],
        print_fn=lines.append,
    )
    timers(INTERVAL_TIME).start(barrier=True)
    return log, timers


def run(log: TrainingLog, n: int = len(SEQUENCE), **kw: Any) -> None:
    for i, (loss, skipped) in enumerate(SEQUENCE[:n], start=1):
        log.on_iteration(
            i,
            losses={"lm loss": torch.tensor(loss), "aux loss": torch.tensor(0.5)},
            learning_rate=1e-3,
            global_batch_size=GBS,
            consumed_samples=GBS * i,
            grad_norm=torch.tensor(1.5),
            skipped=skipped,
            loss_scale=1.0,
            num_zeros=torch.tensor(7.0),
            params_norm=torch.tensor(10.25),
            **kw,
        )


def expected(it: int, lm: str, skipped: int, nan: int) -> str:
    return (
        f" iteration {it:8d}/      10 | consumed samples: {GBS * it:12d} |"
        " elapsed time per iteration (ms): X | learning rate: 1.000000E-03 |"
        f" global batch size:     8 | lm loss: {lm} | aux loss: 5.000000E-01 |"
        " loss scale: 1.0 | grad norm: 1.500 | num zeros: 7 | params norm: 10.250 |"
        f" min/max step (ms): 1.50 | number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nan:3d} |"
    )


def test_iteration_lines_exact(tmp_path: Path) -> None:
    lines: list[str] = []
    log, _ = make_log(lines, tmp_path)
    run(log)
    log.close()
    masked = [re.sub(r"iteration \(ms\): \d+\.\d", "iteration (ms): X", ln) for ln in lines]
    assert masked == [
        expected(1, "2.000000E+00", 0, 0),  # the first iteration is always logged
        expected(3, "2.500000E+00", 0, 0),  # (1 + 4) / 2: the interval restarts after it 1
        expected(6, "4.000000E+00", 1, 1),  # (3 + 5) / 2: the skipped NaN step is excluded
    ]
    infos = log.providers[0].infos  # type: ignore[attr-defined]
    assert [(i.iteration, i.num_iterations, i.is_first) for i in infos] == [
        (1, 1, True),
        (3, 2, False),
        (6, 3, False),
    ]


def test_metrics_file_records(tmp_path: Path) -> None:
    log, _ = make_log([], tmp_path)
    run(log)
    log.on_eval(6, {"lm loss": torch.tensor(2.0)})
    log.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 3, 6]
    assert [r["loss"] for r in train] == [2.0, 2.5, 4.0]
    assert [r["lm loss"] for r in train] == [2.0, 2.5, 4.0]
    assert [r["consumed_samples"] for r in train] == [8, 24, 48]
    last = train[-1]
    assert last["lr"] == 1e-3 and last["grad_norm"] == 1.5 and last["aux loss"] == 0.5
    assert last["skipped_iterations"] == 1 and last["nan_iterations"] == 1
    assert last["total_skipped_iterations"] == 1 and last["straggler-ms"] == 1.5
    assert last["num_zeros"] == 7.0 and last["params_norm"] == 10.25
    assert all(isinstance(r["elapsed_ms"], float) and r["elapsed_ms"] >= 0 for r in train)
    (val,) = [r for r in recs if r["split"] == "validation"]
    assert val["iteration"] == 6 and val["lm loss validation"] == 2.0
    assert val["lm loss validation ppl"] == pytest.approx(math.exp(2.0))


def test_sink_keys_every_tensorboard_interval() -> None:
    sink = RecSink()
    log, _ = make_log(
        [], sink=sink, tensorboard_log_interval=2, log_timers_to_tensorboard=True,
        log_world_size_to_tensorboard=True,
    )  # fmt: skip
    run(log)
    assert sorted(sink.series("lm loss")) == [2, 4, 6]  # TB interval, independent of logging
    assert math.isnan(sink.series("lm loss")[4])  # per-iteration value, as Megatron
    assert sorted(sink.series("lm loss vs samples")) == [16, 32, 48]
    for key in (
        "learning-rate",
        "batch-size",
        "world-size",
        "loss-scale",
        "grad-norm",
        "num-zeros",
        "params-norm",
    ):
        assert sorted(sink.series(key)) == [2, 4, 6], key
        assert sorted(sink.series(f"{key} vs samples")) == [16, 32, 48], key
    # log-step keys: iteration-time skipped on the first (start-up) interval
    assert sorted(sink.series("iteration-time")) == [3, 6]
    assert all(0 <= v < 5.0 for v in sink.series("iteration-time").values())  # seconds
    assert sink.series("world-size")[2] == 1.0
    assert sorted(sink.series("straggler-ms")) == [1, 3, 6]


def test_validation_block_exact() -> None:
    text = " validation loss at iteration 6 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert format_validation_lines(6, {"lm loss": 2.0}) == [
        "-" * (len(text) + 1),
        text,
        "-" * (len(text) + 1),
    ]
    capped = format_validation_lines(1, {"lm loss": 50.0})[1]
    assert f"PPL: {math.exp(20):.6E}" in capped


def test_timestamp_throughput_and_first_line_format() -> None:
    lines: list[str] = []
    timers = Timers(0, TimingLogOption.MINMAX)
    config = LogConfig(log_interval=5, log_throughput=True, log_format="megatron")
    log = TrainingLog(
        config,
        train_iters=10,
        sink=NullSink(),
        timers=timers,
        rank=0,
        world_size=1,
        flops_per_iteration=1e12,
        print_fn=lines.append,
    )
    timers(INTERVAL_TIME).start()
    run(log, n=1)
    assert re.match(
        r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration        1/      10 \|", lines[0]
    )
    assert "| throughput per GPU (TFLOP/s/GPU): " in lines[0]
    with pytest.raises(ValueError, match="--log-throughput"):
        TrainingLog(config, train_iters=1, sink=NullSink(), timers=timers, rank=0, world_size=1)
    with pytest.raises(ValueError, match="--log-interval"):
        LogConfig(log_interval=0)
    with pytest.raises(ValueError, match="--tensorboard-log-interval"):
        LogConfig(tensorboard_log_interval=0)


# ----------------------------------------------------------------------------- host-sync counting
_READS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__format__",
)


@pytest.fixture
def sync_counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every Tensor method that copies a value to the host (a sync on an accelerator)."""
    calls: list[str] = []

    def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            calls.append(name)
            return orig(self, *a, **k)

        return counted

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    orig_to = torch.Tensor.to

    def counted_to(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        out = orig_to(self, *a, **k)
        if out.device != self.device:
            calls.append("to")
        return out

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    yield calls


def test_zero_host_reads_on_non_log_iterations(sync_counter: list[str]) -> None:
    log, _ = make_log([], sink=RecSink(), log_interval=5, tensorboard_log_interval=100)
    per_iteration = []
    for i in range(1, 8):
        before = len(sync_counter)
        log.on_iteration(
            i,
            losses={"lm loss": torch.tensor(float(i))},
            learning_rate=torch.tensor(0.1),
            global_batch_size=GBS,
            consumed_samples=GBS * i,
            grad_norm=torch.tensor(2.0),
            skipped=torch.tensor(i == 3),
            num_zeros=torch.tensor(1.0),
        )
        per_iteration.append(sync_counter[before:])
    assert per_iteration == [["tolist"], [], [], [], ["tolist"], [], []]


def test_other_ranks_never_read_the_device(sync_counter: list[str]) -> None:
    lines: list[str] = []
    log, _ = make_log(lines, sink=RecSink(), rank=1)
    run(log)
    assert sync_counter == [] and lines == []


def test_progress_bar_only_on_tty() -> None:
    quiet = io.StringIO()
    bar = ProgressBar(10, stream=quiet)  # StringIO is not a TTY
    bar.update(5)
    bar.close()
    assert not bar.enabled and quiet.getvalue() == ""
    loud = io.StringIO()
    bar = ProgressBar(10, enabled=True, stream=loud, width=10, min_interval_s=0.0, use_tqdm=False)
    bar.update(5, "lm loss 2.5")
    assert bar.render().startswith("[#####.....]  5/10  50.0% [00:00<")
    assert bar.render().endswith("lm loss 2.5")
    bar.clear()
    bar.update(10)
    bar.close()
    assert loud.getvalue().endswith("lm loss 2.5\n") and "10/10 100.0%" in loud.getvalue()


def test_an_iteration_skipped_without_a_pass_counts_as_skipped_not_nan(tmp_path: Path) -> None:
    """``--iterations-to-skip`` (no pass, no loss: ``losses={}``): Megatron's "number of
    skipped iterations" counts it; it is no NaN iteration and adds no loss (it was logged as
    ``lm loss: NAN`` and counted as a NaN iteration). An interval of only such iterations prints
    no loss; a mixed one averages its trained iterations."""
    lines: list[str] = []
    log, _ = make_log(lines, tmp_path, log_interval=2)
    plan = [(1, 3.0), (2, None), (3, 5.0), (4, None)]  # (iteration, loss or skipped)
    for it, loss in plan:
        log.on_iteration(
            it,
            losses={} if loss is None else {"lm loss": torch.tensor(loss)},
            learning_rate=1e-3, global_batch_size=GBS, consumed_samples=GBS * it,
            grad_norm=None if loss is None else torch.tensor(1.0), skipped=loss is None,
        )  # fmt: skip
    log.on_iteration(5, losses={}, learning_rate=1e-3, global_batch_size=GBS,
                     consumed_samples=GBS * 5, grad_norm=None, skipped=True)  # fmt: skip
    log.on_iteration(6, losses={}, learning_rate=1e-3, global_batch_size=GBS,
                     consumed_samples=GBS * 6, grad_norm=None, skipped=True)  # fmt: skip
    log.close()
    counts = [re.search(r"skipped iterations: +(\d+) \| number of nan iterations: +(\d+)", ln)
              for ln in lines]  # fmt: skip
    assert [m.groups() if m else None for m in counts] == [
        ("0", "0"),  # iteration 1
        ("1", "0"),  # 2: skipped
        ("1", "0"),  # 3-4: 4 skipped
        ("2", "0"),  # 5-6: both skipped
    ]
    assert "lm loss: 3.000000E+00" in lines[0]
    assert "lm loss" not in lines[1]  # only a skipped iteration: no loss to show
    assert "lm loss: 5.000000E+00" in lines[2]  # the trained iteration 3 alone
    assert "lm loss" not in lines[3] and "NAN" not in "".join(lines)
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert [(r["skipped_iterations"], r["nan_iterations"]) for r in train] == [
        (0, 0), (1, 0), (1, 0), (2, 0)
    ]  # fmt: skip
    assert train[-1]["total_skipped_iterations"] == 4 and train[-1]["total_nan_iterations"] == 0
