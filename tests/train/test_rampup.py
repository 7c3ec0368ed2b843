"""``--rampup-batch-size START INCREMENT RAMP_SAMPLES``: Megatron's batch-size ramp, resumable."""

from __future__ import annotations

import json

import pytest

from stalwart.data.batch_schedule import BatchSchedule
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config


def test_schedule_follows_megatrons_formula() -> None:
    s = BatchSchedule.from_flags(12, 4, 1, [4, 4, 32])  # 2 steps of 16 samples each
    sizes = {c: s.global_batch_size_at(c) for c in (0, 12, 15, 16, 31, 32, 1000)}
    assert sizes == {0: 4, 12: 4, 15: 4, 16: 8, 31: 8, 32: 12, 1000: 12}
    assert [s.num_microbatches_at(c) for c in (0, 16, 32)] == [1, 2, 3]
    assert BatchSchedule.from_flags(12, 4, 1, None).global_batch_size_at(0) == 12
    assert BatchSchedule.from_flags(12, 4, 1, [4, 4, 0]).global_batch_size_at(0) == 12


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((12, 4, 1, [4, 3, 32]), "multiple of INCREMENT"),
        ((12, 4, 1, [12, 4, 32]), "positive multiple"),
        ((12, 4, 1, [0, 4, 32]), "START and INCREMENT must be >= 1"),
        ((12, 2, 2, [6, 2, 32]), "batch sizes [6, 10] are not multiples"),
        ((12, 4, 1, [4, 4]), "three integers"),
    ],
)
def test_bad_ramps_name_the_flag(args, needle) -> None:
    with pytest.raises(ValueError, match="--rampup-batch-size") as info:
        BatchSchedule.from_flags(*args)
    assert needle in str(info.value)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trainer_ramps_saves_at_each_step_and_resumes_exactly(tmp_path) -> None:
    common = ["--train-iters", "8", "--seed", "5", "--log-interval", "1", "--micro-batch-size",
              "4", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "32"]  # fmt: skip
    straight = tmp_path / "straight"
    run_training(make_config(*common, "--save", str(straight), "--metrics-file",
                             str(tmp_path / "a.jsonl")), DistributedContext())  # fmt: skip
    records = _records(tmp_path / "a.jsonl")
    assert [r["global_batch_size"] for r in records] == [4, 4, 4, 4, 8, 8, 12, 12]
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 16, 24, 32, 44, 56]
    # A checkpoint where the micro-batch count steps up (before iterations 5 and 7), as Megatron.
    assert sorted(p.name for p in straight.glob("iter_*")) == [
        "iter_0000004", "iter_0000006", "iter_0000008",
    ]  # fmt: skip

    split = tmp_path / "split"
    first = make_config(*common, "--save", str(split), "--exit-interval", "5")
    assert run_training(first, DistributedContext()).iteration == 5  # inside the ramp
    outcome = run_training(make_config(*common, "--save", str(split)), DistributedContext())
    assert (outcome.iteration, outcome.exit_code) == (8, 0)
    assert_params_equal(load_params(split), load_params(straight))


def test_ramp_with_full_iteration_graphs_is_refused() -> None:
    with pytest.raises(ValueError, match="--rampup-batch-size with --cuda-graph-impl"):
        make_config("--rampup-batch-size", "4", "4", "32", "--global-batch-size", "12",
                    "--cuda-graph-impl", "full_iteration")  # fmt: skip


def test_iterations_for_samples_follow_the_ramp() -> None:
    ramp = BatchSchedule.from_flags(12, 4, 1, [4, 4, 32])  # 4,4,4,4,8,8 (32 samples), then 12s
    assert ramp.iterations_for_samples(32) == 6
    assert ramp.iterations_for_samples(33) == 7
    assert ramp.iterations_for_samples(56) == 8
    assert ramp.iterations_for_samples(1) == 1
    assert BatchSchedule.from_flags(12, 4, 1, None).iterations_for_samples(100) == 9


def test_train_samples_with_a_sample_based_warmup(tmp_path) -> None:
    """56 samples over the ramp are 8 iterations; a 16-sample warm-up reaches --lr after the 4th
    iteration (16 samples), whatever the batch sizes."""
    args = [
        "--train-samples",
        "56",
        "--seed",
        "5",
        "--log-interval",
        "1",
        "--lr",
        "1e-3",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "12",
        "--rampup-batch-size",
        "4",
        "4",
        "32",
        "--lr-warmup-samples",
        "16",
        "--lr-decay-style",
        "constant",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
        "--lr-warmup-iters",
        "0",
    ]  # fmt: skip  (TINY_FLAGS warm up in iterations)
    outcome = run_training(make_config(*args), DistributedContext())
    assert outcome.iteration == 8
    records = _records(tmp_path / "m.jsonl")
    assert [round(r["lr"] / 1e-3, 6) for r in records] == [0.25, 0.5, 0.75, 1, 1, 1, 1, 1]
    assert records[-1]["consumed_samples"] == 56


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train-samples", "64", "--train-iters", "5"], "mutually exclusive"),
        (["--train-samples", "64", "--lr-decay-iters", "5"], "--lr-warmup-samples"),
        (["--lr-warmup-samples", "8"], "need --train-samples"),
        (["--train-samples", "0"], "--train-samples must be > 0"),
    ],
)
def test_sample_flag_errors(args, needle) -> None:
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config

    argv = ["--preset", "tiny", *args]
    with pytest.raises(ValueError, match=needle):
        build_run_config(parse_train_args(argv), argv)
