from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stalwart.observability.sinks import (
    FanOutSink,
    JsonlSink,
    NullSink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    is_null_sink,
)


class RecSink(NullSink):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object, int]] = []

    def add_scalar(self, name, value, step):  # type: ignore[no-untyped-def]
        self.calls.append((name, value, step))

    def add_scalars(self, values, step):  # type: ignore[no-untyped-def]
        self.calls.extend((k, v, step) for k, v in values.items())

    def add_text(self, name, text, step):  # type: ignore[no-untyped-def]
        self.calls.append((name, text, step))


def test_fan_out_writes_every_call_to_every_child() -> None:
    a, b = RecSink(), RecSink()
    fan = FanOutSink([a, b])
    fan.add_scalar("x", 1.0, 1)
    fan.add_scalars({"y": 2.0, "z": 3.0}, 2)
    fan.add_text("t", "hello", 2)
    fan.flush()
    fan.close()
    assert a.calls == b.calls == [("x", 1.0, 1), ("y", 2.0, 2), ("z", 3.0, 2), ("t", "hello", 2)]


def test_jsonl_groups_by_step_and_writes_records(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    sink = JsonlSink(str(path))
    sink.add_scalar("a", 1.0, 1)
    sink.add_scalars({"b": 2.5}, 1)
    sink.add_scalars({"a": float("nan")}, 2)
    sink.write_record({"iteration": 3, "loss": 0.1234567890123})
    sink.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "a": 1.0, "b": 2.5},
        {"step": 2, "a": None},  # strict JSON: non-finite -> null
        {"iteration": 3, "loss": 0.1234567890123},
    ]


def test_build_sinks_rank_and_nothing_configured(tmp_path: Path) -> None:
    assert is_null_sink(build_sinks(rank=0))
    assert is_null_sink(build_sinks(rank=1, tensorboard_dir=str(tmp_path)))  # rank 0 only
    sink = build_sinks(rank=0, tensorboard_dir=str(tmp_path))
    assert isinstance(sink, TensorBoardSink)
    sink.close()
    # The CLI/config parse --wandb-mode once; a string reaching the component is refused on
    # every rank (rank 1 too), before wandb is imported.
    for rank in (0, 1):
        with pytest.raises(TypeError, match="WandbMode"):
            build_sinks(rank=rank, wandb_project="p", wandb_mode="offline")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WandbMode"):
        WandbSink("p", mode="offline")  # type: ignore[arg-type]


def test_missing_optional_dependencies_have_clear_messages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="tensorboard"):
        TensorBoardSink(str(tmp_path))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="stalwart\\[wandb\\]"):
        WandbSink("proj")
