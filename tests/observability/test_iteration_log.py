"""Every iteration's row: kept on the device, read with the log step's one transfer, written to
``<metrics stem>.iterations.jsonl`` and the dashboards; off with ``log_every_iteration=False``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_log import GBS, RecSink, make_log, run, sync_counter  # noqa: F401

from stalwart.observability.iteration_ring import IterationRing
from stalwart.observability.run_dir import iterations_path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_one_row_per_iteration_with_its_own_values(tmp_path: Path) -> None:
    sink = RecSink()
    log, _ = make_log([], tmp_path=tmp_path, sink=sink, log_interval=3)
    run(log)  # 7 iterations: log steps 1, 3, 6; 7 is pending until the flush
    assert [r["iteration"] for r in _rows(tmp_path / "metrics.iterations.jsonl")] == [*range(1, 7)]
    log.flush()
    log.close()
    rows = _rows(tmp_path / "metrics.iterations.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 8))
    assert [r["loss"] for r in rows] == [2.0, 1.0, 4.0, None, 3.0, 5.0, -1.0]  # NaN: null
    assert [r["skipped"] for r in rows] == [False] * 3 + [True] + [False] * 3
    assert [r["nan"] for r in rows] == [False] * 3 + [True] + [False] * 3
    assert [r["consumed_samples"] for r in rows] == [GBS * i for i in range(1, 8)]
    assert all(r["aux loss"] == 0.5 and r["grad_norm"] == 1.5 and r["lr"] == 1e-3 for r in rows)
    assert all(r["num_zeros"] == 7.0 and r["params_norm"] == 10.25 for r in rows)
    times = [r["wall_time"] for r in rows]
    assert times == sorted(times)
    # The dashboards: Megatron's per-iteration keys at every iteration (interval 1), from the ring.
    assert sorted(sink.series("lm loss")) == list(range(1, 8))
    assert sorted(sink.series("grad-norm vs samples")) == [GBS * i for i in range(1, 8)]
    # The log-interval records are unchanged: metrics.jsonl has no per-iteration row.
    records = _rows(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records if r["split"] == "train"] == [1, 3, 6, 7]


def test_rows_ride_on_the_log_steps_one_read(sync_counter: list[str]) -> None:  # noqa: F811
    """No read on the other iterations, one per log step: the ring adds no transfer."""
    log, _ = make_log([], sink=RecSink(), log_interval=4)
    per_iteration = []
    for i in range(1, 9):
        before = len(sync_counter)
        log.on_iteration(
            i,
            losses={"lm loss": torch.tensor(float(i))},
            learning_rate=torch.tensor(0.1),
            global_batch_size=GBS,
            consumed_samples=GBS * i,
            grad_norm=torch.tensor(2.0 * i),
            skipped=torch.tensor(False),
        )
        per_iteration.append(sync_counter[before:])
    assert per_iteration == [["tolist"], [], [], ["tolist"], [], [], [], ["tolist"]]


def test_off_is_the_old_path_no_file_and_the_dashboards_read_at_their_steps(
    tmp_path: Path,
    sync_counter: list[str],  # noqa: F811
) -> None:
    sink = RecSink()
    log, _ = make_log([], tmp_path=tmp_path, sink=sink, log_every_iteration=False)
    run(log, n=5)
    log.close()
    assert not (tmp_path / "metrics.iterations.jsonl").exists()
    assert sorted(sink.series("lm loss")) == [1, 2, 3, 4, 5]  # read at each sink step
    assert sync_counter.count("tolist") == 5


def test_ring_grows_for_a_longer_interval_and_a_wider_row() -> None:
    ring = IterationRing(capacity=2)
    for i in range(1, 6):
        values: dict[str, Any] = {"a": torch.tensor(float(i)), "host": i * 10}
        if i >= 4:
            values["b"] = torch.tensor([float(-i)])  # a one-element tensor, a wider row
        ring.write(i, values, {"t": i})
    flat = ring.to_read()
    assert flat is not None
    rows = ring.rows(flat.tolist())
    assert [r["a"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r.get("b") for r in rows] == [None, None, None, -4.0, -5.0]
    assert [r["host"] for r in rows] == [10, 20, 30, 40, 50] and len(ring) == 0
    assert ring.to_read() is None


def test_iterations_path_is_beside_any_metrics_file() -> None:
    assert iterations_path("runs/x/metrics.jsonl") == Path("runs/x/metrics.iterations.jsonl")
    assert iterations_path("/m/log") == Path("/m/log.iterations.jsonl")


@pytest.mark.parametrize("bad", [0, -1])
def test_ring_capacity_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        IterationRing(bad)


def test_non_finite_grad_norm_is_null_in_the_row(tmp_path: Path) -> None:
    log, _ = make_log([], tmp_path=tmp_path, log_interval=2)
    for i in (1, 2):
        log.on_iteration(
            i,
            losses={"lm loss": torch.tensor(1.0)},
            learning_rate=0.5,
            global_batch_size=GBS,
            consumed_samples=GBS * i,
            grad_norm=torch.tensor(math.inf if i == 2 else 1.0),
            skipped=i == 2,
        )
    log.close()
    rows = _rows(tmp_path / "metrics.iterations.jsonl")
    assert [r["grad_norm"] for r in rows] == [1.0, None]
    assert [r["skipped"] for r in rows] == [False, True] and rows[0]["lr"] == 0.5
