"""The trainer's registered checkpoint parts: JSON-friendly state (numbers, strings, lists,
dicts, plus tensors) that loads back after a JSON round trip, as the checkpoint stores it."""

from __future__ import annotations

import json
from typing import Any

import torch

from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import Trainer

from train_utils import make_config


def _json_round_trip(state: Any) -> Any:
    """Tensors kept aside, everything else through ``json`` (tuples come back as lists)."""
    tensors: list[torch.Tensor] = []

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.clone())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(value, dict):
            assert all(isinstance(k, str) for k in value), f"non-string keys in {value!r}"
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [encode(v) for v in value]
        assert value is None or isinstance(value, bool | int | float | str), type(value)
        return value

    def decode(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if isinstance(value, dict):
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(json.loads(json.dumps(encode(state))))


def _parts(trainer: Trainer) -> dict[str, Any]:
    return {**trainer.checkpointer.common, **trainer.checkpointer.per_rank}


def test_every_part_is_json_friendly_and_loads_after_a_round_trip() -> None:
    config = make_config("--train-iters", "3", "--check-for-spiky-loss")
    with Trainer(config, DistributedContext()) as first:
        first.train()
        saved = {name: _json_round_trip(part.state_dict()) for name, part in _parts(first).items()}
    assert set(saved) == {"step", "train_state", "data", "scheduler", "config", "rng", "rerun"}
    with Trainer(config, DistributedContext()) as second:
        for name, part in _parts(second).items():
            part.load_state_dict(saved[name])
        assert second.state.iteration == 3
        again = {name: _json_round_trip(part.state_dict()) for name, part in _parts(second).items()}
    for name in ("step", "train_state", "data", "scheduler"):
        assert again[name] == saved[name], name
    assert again["rerun"]["ranks"][0]["large_values"] == saved["rerun"]["ranks"][0]["large_values"]
    device_windows = saved["rerun"]["ranks"][0]["device_large_values"]
    assert device_windows["loss"][0] == 3.0  # three samples of the spiky-loss window
    assert again["rerun"]["ranks"][0]["device_large_values"] == device_windows
    assert torch.equal(again["rng"]["torch_cpu"], saved["rng"]["torch_cpu"])
    assert again["rng"]["python"] == saved["rng"]["python"]
