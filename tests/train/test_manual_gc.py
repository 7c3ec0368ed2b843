"""``--manual-gc``: the automatic collector is off during training; collections happen at fixed
iterations and around evaluation; the collector is restored afterwards."""

from __future__ import annotations

import gc

import pytest

from stalwart.distributed.process_group import DistributedContext
from stalwart.train.manual_gc import ManualGC
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config


@pytest.fixture
def collections(monkeypatch) -> list[bool]:
    """Every gc.collect() call, recorded as whether the automatic collector was on then."""
    calls: list[bool] = []
    real = gc.collect

    def counting(*args, **kwargs):
        calls.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(gc, "collect", counting)
    return calls


def test_collects_every_interval_and_restores(collections) -> None:
    assert gc.isenabled()
    manual = ManualGC(3, collect_at_eval=False)
    assert not gc.isenabled()
    for completed in range(1, 8):
        manual.on_iteration_end(completed)
    manual.on_evaluation()  # off for evaluation here
    assert manual.num_collections == len(collections) == 1 + 2  # setup, 3, 6
    manual.close()
    manual.close()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        ManualGC(0).close()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_trainer_collects_at_fixed_iterations_and_evaluations(tmp_path, collections) -> None:
    common = ["--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", "--seed", "3"]
    run_training(make_config(*common, "--save", str(tmp_path / "auto")), DistributedContext())
    assert collections == []  # nothing collects explicitly without --manual-gc
    manual = ["--manual-gc", "--manual-gc-interval", "2", "--save", str(tmp_path / "manual")]
    run_training(make_config(*common, *manual), DistributedContext())
    # setup + iterations 2, 4, 6 + before and after the evaluations at 3 and 6
    assert len(collections) == 1 + 3 + 2 * 2
    assert not any(collections)  # the automatic collector was off throughout
    assert gc.isenabled()
    assert_params_equal(load_params(tmp_path / "manual"), load_params(tmp_path / "auto"))


def test_bad_interval() -> None:
    from stalwart.config.training import TrainingConfig

    with pytest.raises(ValueError, match="--manual-gc-interval"):
        TrainingConfig(manual_gc=True, manual_gc_interval=-1)
