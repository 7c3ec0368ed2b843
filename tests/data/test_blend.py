"""Blended data (``--data-path 0.3 a 0.7 b``): Megatron's syntax, proportions in every prefix."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.data import BlendedDataset, TokenDataset, build_datasets, parse_data_blend
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from train_utils import make_config


def test_parse_forms() -> None:
    assert parse_data_blend(None) is None
    assert parse_data_blend("a.bin") == [(1.0, "a.bin")]
    assert parse_data_blend(["a.bin"]) == [(1.0, "a.bin")]
    assert parse_data_blend(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    assert parse_data_blend(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]


@pytest.mark.parametrize(
    "bad",
    [["0.3", "a", "0.7"], ["0", "a", "1", "b"], ["-1", "a", "2", "b"], ["a", "0.5"], []],
)
def test_parse_errors_name_the_flag(bad) -> None:
    with pytest.raises(ValueError, match="--data-path"):
        parse_data_blend(bad)


def _source(n: int, offset: int, seq: int = 4) -> TokenDataset:
    return TokenDataset(np.arange(n * seq + 1, dtype=np.int64) + offset, seq)


def test_every_prefix_holds_each_source_in_proportion() -> None:
    small, large = _source(10, 0), _source(30, 10_000)
    blend = BlendedDataset([small, large], [3.0, 1.0])  # the small source is upsampled 3x
    assert len(blend) == 40
    ids = [blend.source_of(i) for i in range(len(blend))]
    for k in range(1, len(ids) + 1):
        assert abs(ids[:k].count(0) - 0.75 * k) <= 1.0, k
    # Sample contents come from the mapped source; the small one repeats, in order.
    from_small = [int(blend.window(i)[0]) for i in range(len(blend)) if ids[i] == 0]
    assert from_small == [4 * (j % 10) for j in range(30)]
    assert all(int(blend.window(i)[0]) >= 10_000 for i in range(len(blend)) if ids[i] == 1)
    with pytest.raises(IndexError):
        blend.window(40)


def test_tiny_weights_still_get_a_sample() -> None:
    blend = BlendedDataset([_source(5, 0), _source(5, 100), _source(5, 200)], [1e-6, 1.0, 1.0])
    ids = [blend.source_of(i) for i in range(len(blend))]
    assert len(ids) == 15 and ids.count(0) == 1


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_trainer_on_a_blend_of_two_files(tmp_path) -> None:
    a = _write(tmp_path / "a.txt", "abcdefgh" * 2000)
    b = _write(tmp_path / "b.txt", "0123456789" * 800)
    train, valid = build_datasets(["0.25", a, "0.75", b], 32, 256, valid_fraction=0.1)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    firsts = [chr(int(train.window(i)[0])) for i in range(len(train))]
    letters = sum(c.isalpha() for c in firsts)
    assert abs(letters - 0.25 * len(firsts)) <= 1
    config = make_config("--train-iters", "3", "--vocab-size", "256", "--data-path", "0.25", a,
                         "0.75", b, "--save", str(tmp_path / "ckpt"))  # fmt: skip
    assert config.data.data_path == ["0.25", a, "0.75", b]
    assert run_training(config, DistributedContext()).exit_code == 0
    single = make_config("--data-path", a)
    assert single.data.data_path == a


def test_resuming_under_another_blend_of_the_same_length_is_refused() -> None:
    from stalwart.data.sampler import MicroBatchIterator

    def sampler(weights: list[float]) -> MicroBatchIterator:
        blend = BlendedDataset([_source(10, 0), _source(30, 10_000)], weights)
        return MicroBatchIterator(blend, 2, 0, 1, seed=5)

    saved = sampler([3.0, 1.0])
    next(saved)
    state = saved.state_dict()
    resumed = sampler([3.0, 1.0])
    resumed.load_state_dict(state)
    assert resumed.consumed_samples == 2
    other = sampler([1.0, 1.0])  # same total length (40), other weights
    with pytest.raises(ValueError, match="--data-path") as err:
        other.load_state_dict(state)
    assert "0.75 x 10 samples" in str(err.value) and "0.5 x 10 samples" in str(err.value)
    legacy = {k: v for k, v in state.items() if k != "dataset_identity"}
    other.load_state_dict(legacy)  # checkpoints written before the check still load
