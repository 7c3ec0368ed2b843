"""Resume is exact on CPU: 20 iterations straight == 10 + resume + 10, bitwise."""

from __future__ import annotations

import json

from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config


def _losses(path) -> list[float]:
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return [r["loss"] for r in records if r.get("split") == "train"]


def test_resume_is_bitwise_exact(tmp_path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--train-iters", "20", "--log-interval", "1", "--seed", "7"]
    run_training(
        make_config(*common, "--save", str(straight), "--metrics-file", str(tmp_path / "a.jsonl")),
        DistributedContext(),
    )
    first = make_config(*common, "--save", str(split), "--exit-interval", "10",
                        "--metrics-file", str(tmp_path / "b.jsonl"))  # fmt: skip
    outcome = run_training(first, DistributedContext())
    assert outcome.iteration == 10 and outcome.reason.value == "interval"
    outcome = run_training(
        make_config(*common, "--save", str(split), "--metrics-file", str(tmp_path / "b.jsonl")),
        DistributedContext(),
    )
    assert outcome.iteration == 20 and outcome.exit_code == 0
    assert_params_equal(load_params(straight), load_params(split))
    a, b = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert len(a) == len(b) == 20
    assert a == b  # identical logged losses, float for float
    assert a[-1] < a[0]
