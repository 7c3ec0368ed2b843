"""The compact log line (the default) and Megatron's (``--log-format megatron``): the compact
one is short and keeps significant digits, the counters and providers' fields appear where they
say something, and both formats write the same metrics file (issue 44 item 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.observability.log_lines import (
    IntervalSummary,
    LogField,
    LogFormat,
    format_compact_line,
    format_compact_timers,
    format_compact_validation,
    format_iteration_line,
    significant,
)
from stalwart.observability.sinks import NullSink
from stalwart.observability.straggler_report import build_report
from stalwart.observability.timer_names import INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption
from stalwart.observability.train_log import LogConfig, TrainingLog


def _summary(**changes: Any) -> IntervalSummary:
    values: dict[str, Any] = dict(
        iteration=20,
        train_iters=150,
        consumed_samples=160,
        elapsed_ms=907.84,
        global_batch_size=8,
        loss_averages={"lm loss": 4.744249},
        skipped=0,
        nan=0,
        learning_rate=1.977435e-3,
        grad_norm=1.4291,
        timestamp="21:56:30",
        tokens_per_second=1128.4,
        tokens_per_second_per_gpu=1128.4,
        tflops_per_gpu=0.0024512,
        extra_fields=(
            LogField("compute ms min", 795.0, "{:.1f}", "straggler/compute-ms-min", compact=False),
            LogField("goodput", 85.51, "{:.1f}%", "goodput"),
            LogField("mem max RSS (MB)", 532.6, "{:.1f}", short="max RSS {} MB"),
        ),
    )
    values.update(changes)
    return IntervalSummary(**values)


def test_the_compact_line_field_by_field() -> None:
    line = format_compact_line(_summary())
    assert line == (
        "[21:56:30] iteration 20/150 | lm loss 4.744 | lr 1.98e-03 | grad norm 1.43 | "
        "908 ms/it | 1.13k tok/s | goodput 85.5% | max RSS 532.6 MB"
    )
    assert len(line) < 140  # Megatron's line of the same interval is over 400 characters
    assert len(format_iteration_line(_summary())) > 300


def test_the_compact_line_shows_what_is_not_routine() -> None:
    line = format_compact_line(
        _summary(
            skipped=2,
            nan=1,
            throughput=0.0024512,
            mfu_percent=45.123,
            loss_scale=65536.0,
            tokens_per_second=534_000.0,
            tokens_per_second_per_gpu=66_750.0,
            elapsed_ms=2539.2,
            timestamp=None,
        )
    )
    assert line.startswith("iteration 20/150 | lm loss 4.744 | lr 1.98e-03 | grad norm 1.43")
    assert "| loss scale 65,536 |" in line  # fp16's scale; 1.0 (no scaling) is left out
    assert (
        "| 2,539 ms/it | 534k tok/s | 66.8k tok/s/GPU | 0.00245 TFLOP/s/GPU | MFU 45.1% |" in line
    )
    assert line.endswith("| skipped 2 | nan 1")
    assert "compute ms" not in line  # compact=False: the sinks and the file have it


def test_throughput_keeps_significant_digits_and_one_spelling() -> None:
    assert significant(0.0024512) == "0.00245"  # a CPU: not 0.0
    assert significant(312.44) == "312.4" and significant(0.0) == "0.0"  # Megatron's {:.1f}
    megatron = format_iteration_line(_summary(throughput=0.0024512))
    assert "| throughput per GPU (TFLOP/s/GPU): 0.00245 |" in megatron
    assert megatron.count("TFLOP/s") == 1
    # Without --log-throughput the field moves after Megatron's last one, spelled the same.
    tail = format_iteration_line(_summary()).split("number of nan iterations:   0 |")[1]
    assert tail == (
        " tokens per second: 1128 | tokens per second per GPU: 1128 |"
        " throughput per GPU (TFLOP/s/GPU): 0.00245 |"
    )


def test_compact_timers_and_validation() -> None:
    pairs = {"forward-backward": (795.04, 798.12), "optimizer": (108.4, 108.4)}
    assert format_compact_timers(pairs, minmax=True) == (
        "  time (ms, min-max over ranks): forward-backward 795-798 | optimizer 108"
    )
    assert format_compact_timers(pairs, minmax=False) == (
        "  time (ms, max over ranks): forward-backward 798 | optimizer 108"
    )
    assert format_compact_timers({}, minmax=True) is None
    assert format_compact_validation(50, {"lm loss": 3.47574}) == (
        "validation at iteration 50 | lm loss 3.476 (ppl 32.3)"
    )


def test_straggler_fields_in_the_compact_line() -> None:
    alone = build_report(5, [800.0], threshold=1.5, comm_ms=[3.0])
    assert [f.label for f in alone.fields() if f.compact] == []  # one rank: nothing to say
    two = build_report(5, [800.0, 1600.0], threshold=1.2, comm_ms=[3.0, 1.0])
    line = format_compact_line(_summary(extra_fields=tuple(two.fields()), timestamp=None))
    assert "| slowest rank 1 (0.75x) | stragglers 1 | straggler ranks 1" in line
    assert "compute ms" not in line and "comm ms" not in line


def _log(tmp_path: Path, fmt: str, lines: list[str]) -> TrainingLog:
    timers = Timers(1, TimingLogOption.MINMAX, device=torch.device("cpu"))
    log = TrainingLog(
        LogConfig(log_interval=2, log_format=fmt),
        train_iters=4,
        sink=NullSink(),
        timers=timers,
        rank=0,
        world_size=1,
        flops_per_iteration=1e9,
        metrics_file=str(tmp_path / f"{fmt}.jsonl"),
        print_fn=lines.append,
        seq_length=16,
    )
    timers(INTERVAL_TIME).start(barrier=True)
    return log


@pytest.mark.parametrize("fmt", ["compact", "megatron"])
def test_both_formats_write_the_same_records(tmp_path: Path, fmt: str) -> None:
    lines: list[str] = []
    log = _log(tmp_path, fmt, lines)
    records = []
    for it in range(1, 5):
        log.timers("forward-backward", log_level=1).start()
        log.timers("forward-backward").stop()
        record = log.on_iteration(
            it,
            losses={"lm loss": torch.tensor(2.5)},
            learning_rate=1e-3,
            global_batch_size=8,
            consumed_samples=8 * it,
            grad_norm=torch.tensor(0.5),
            skipped=False,
        )
        records.append(record)
    log.on_eval(4, {"lm loss": 2.0})
    log.close()
    written = [json.loads(x) for x in (tmp_path / f"{fmt}.jsonl").read_text().splitlines()]
    # on_iteration returns the log step's record (what an adapter offers its framework).
    assert [r["iteration"] if r else None for r in records] == [1, 2, None, 4]
    assert [r for r in records if r] == [w for w in written if w["split"] == "train"]
    assert [w["lm loss"] for w in written[:3]] == [2.5, 2.5, 2.5]
    assert written[3]["lm loss validation"] == 2.0
    iteration_lines = [x for x in lines if "iteration 4/4" in x or "iteration        4/" in x]
    assert len(iteration_lines) == 1
    if fmt == "compact":
        assert iteration_lines[0].startswith("[") and "| lm loss 2.5 |" in iteration_lines[0]
        assert any(
            x.startswith("  time (ms, min-max over ranks): forward-backward ") for x in lines
        )
        assert lines[-1] == "validation at iteration 4 | lm loss 2 (ppl 7.39)"
    else:
        assert "| lm loss: 2.500000E+00 |" in iteration_lines[0]
        assert any(x.startswith("(min, max) time across ranks (ms):\n") for x in lines)
        assert lines[-2].startswith(" validation loss at iteration 4 | lm loss value: ")


def test_log_format_is_an_enum_and_a_bad_one_names_the_flag() -> None:
    assert LogConfig().log_format is LogFormat.COMPACT
    assert LogConfig(log_format="megatron").log_format is LogFormat.MEGATRON
    with pytest.raises(ValueError, match="--log-format: got 'json', allowed: compact, megatron"):
        LogConfig(log_format="json")
