"""Hand-built configs get the same checks as the CLI: types, finiteness, declared ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from stalwart.config.checks import bounds, check_fields
from stalwart.config.run import GraphConfig
from stalwart.config.training import DataConfig, OptimizerConfig, TrainingConfig
from stalwart.observability.profiler import ProfilerConfig
from stalwart.observability.sinks import SinkConfig
from stalwart.observability.straggler import StragglerConfig
from stalwart.observability.timers import TimerConfig
from stalwart.reliability.exit import ExitConfig


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: OptimizerConfig(lr=math.inf), "--lr must be a finite number"),
        (lambda: OptimizerConfig(lr=math.nan), "--lr must be a finite number"),
        (lambda: OptimizerConfig(lr=100.0), "--lr must be > 0 and <= 10"),
        (lambda: OptimizerConfig(adam_eps=0.0), "--adam-eps must be > 0"),
        (lambda: OptimizerConfig(clip_grad=True), "--clip-grad must be a finite number"),
        (lambda: TrainingConfig(micro_batch_size=2.5), "--micro-batch-size must be an integer"),
        (lambda: TrainingConfig(train_iters=True), "--train-iters must be an integer"),
        (lambda: TrainingConfig(seed=10**30), "--seed must be an integer"),
        (lambda: TrainingConfig(seed=2**32), "--seed must be >= 0 and <= 4294967295"),
        (lambda: TrainingConfig(use_cpu="no"), "--use-cpu must be true or false"),
        (lambda: TrainingConfig(distributed_timeout_minutes=math.nan), "--distributed-timeout"),
        (lambda: TrainingConfig(rampup_batch_size=[1, -2, 3]), "--rampup-batch-size must be >= 0"),
        (lambda: TrainingConfig(min_loss_scale=4.0, initial_loss_scale=2.0), "--min-loss-scale"),
        (lambda: DataConfig(shuffle="no"), "--no-shuffle must be true or false"),
        (lambda: DataConfig(valid_fraction=math.inf), "--valid-fraction"),
        (lambda: ExitConfig(save_interval=-1), "--save-interval: must be an integer >= 0"),
        (lambda: StragglerConfig(straggler_threshold=math.inf), "--straggler-threshold"),
        (lambda: SinkConfig(wandb_mode="bogus"), "--wandb-mode"),
        (lambda: TimerConfig(timing_log_level=9), "--timing-log-level"),
        (lambda: ProfilerConfig(profile=True, profile_ranks=[0, -1]), "--profile-ranks must be"),
        (lambda: GraphConfig(cuda_graph_warmup_steps=0), "--cuda-graph-warmup-steps must be >= 1"),
    ],
)
def test_bad_field_values_name_the_flag(build, needle: str) -> None:
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(").replace(".", r"\.")):
        build()


def test_good_values_pass_unchanged() -> None:
    opt = OptimizerConfig(lr=1, min_lr=0)  # ints are numbers
    assert opt.lr == 1
    assert TrainingConfig(rampup_batch_size=[4, 4, 100]).rampup_batch_size == [4, 4, 100]
    assert DataConfig(data_path=["a.bin"]).data_path == "a.bin"


def test_check_fields_on_a_users_own_config() -> None:
    @dataclass(kw_only=True)
    class MyConfig:
        lr: float = field(default=1e-3, metadata=bounds(gt=0))
        steps: int | None = field(default=None, metadata=bounds(ge=1, flag="--my-steps"))

        def __post_init__(self) -> None:
            check_fields(self)

    assert MyConfig(steps=3).steps == 3
    with pytest.raises(ValueError, match="--lr must be a finite number"):
        MyConfig(lr=math.inf)
    with pytest.raises(ValueError, match="--my-steps must be >= 1"):
        MyConfig(steps=0)
    with pytest.raises(ValueError, match="--my-steps must be an integer or unset"):
        MyConfig(steps=1.0)  # type: ignore[arg-type]
