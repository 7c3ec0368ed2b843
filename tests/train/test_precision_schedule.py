"""fp16 dynamic loss scaling (overflow skips the step), LR schedule shapes."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from stalwart.config.training import OptimizerConfig
from stalwart.distributed.process_group import DistributedContext
from stalwart.loop import DynamicLossScaler
from stalwart.models import GPT
from stalwart.train.build import seed_everything
from stalwart.train.schedule import learning_rate_at
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config


def test_fp16_overflow_skips_the_step_and_counts_it(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    config = make_config(
        "--fp16", "--initial-loss-scale", "1e30", "--train-iters", "2", "--log-interval", "2",
        "--seed", "5", "--save", str(tmp_path / "ckpt"), "--metrics-file", str(metrics),
    )  # fmt: skip
    run_training(config, DistributedContext())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = records[-1]
    assert last["total_skipped_iterations"] == 2
    assert last["loss_scale"] == pytest.approx(0.5e30)  # halved after --hysteresis 2 overflows
    seed_everything(5)
    fresh = GPT(config.model)
    initial = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    assert_params_equal(load_params(tmp_path / "ckpt"), initial)  # no step was applied


def test_dynamic_loss_scaler_hysteresis_and_growth() -> None:
    scaler = DynamicLossScaler(1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024.0  # first overflow is absorbed by hysteresis
    scaler.update(True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 1024.0
    state = scaler.state_dict()
    other = DynamicLossScaler(1.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    grads = [torch.tensor([1.0, float("inf")])]
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = grads[0]
    found = scaler.unscale_and_check([p])
    assert found is not None and found.item() == 1.0


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule_warmup_then_decay(style: str) -> None:
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_style=style)
    lrs = [learning_rate_at(i, cfg, train_iters=20) for i in range(24)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, never 0
    if style == "constant":
        assert all(lr == 1.0 for lr in lrs[4:])
        return
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))  # monotone decay
    assert lrs[19] == 0.1 and lrs[23] == 0.1  # min_lr at and after --train-iters
    mid = learning_rate_at(11, cfg, train_iters=20)  # halfway through the decay
    expected = 0.55 if style == "linear" else 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))
    assert mid == pytest.approx(expected)


def test_bad_lr_flags() -> None:
    with pytest.raises(ValueError, match="--min-lr"):
        OptimizerConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="--lr-decay-style"):
        OptimizerConfig(lr_decay_style="step")
