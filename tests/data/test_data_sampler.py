from __future__ import annotations

import numpy as np
import pytest
import torch

from stalwart.data import (
    MicroBatchIterator,
    TokenDataset,
    calculate_num_microbatches,
    make_eval_iterator,
)

SEQ = 3


def _dataset(num_samples: int = 37) -> TokenDataset:
    return TokenDataset(np.arange(num_samples * SEQ + 1, dtype=np.int64), SEQ)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """Dataset index of every sample (window start / SEQ)."""
    return [int(v) // SEQ for v in batch["input_ids"][:, 0]]


def test_batch_contents() -> None:
    it = MicroBatchIterator(_dataset(), 4, 0, 1, seed=0, shuffle=False)
    batch = next(it)
    assert batch["input_ids"].shape == (4, SEQ) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)
    assert _ids(batch) == [0, 1, 2, 3] and it.consumed_samples == 4


def test_determinism_and_resume() -> None:
    a = MicroBatchIterator(_dataset(), 4, 0, 1, seed=7)
    for _ in range(10):
        next(a)
    state = a.state_dict()
    assert state["consumed_samples"] == 40 and state["dataset_len"] == 37
    b = MicroBatchIterator(_dataset(), 4, 0, 1, seed=7)
    b.load_state_dict(state)
    for _ in range(12):
        x, y = next(a), next(b)
        assert torch.equal(x["input_ids"], y["input_ids"])
    c = MicroBatchIterator(_dataset(), 4, 0, 1, seed=7, consumed_samples=40)
    d = MicroBatchIterator(_dataset(), 4, 0, 1, seed=7)
    for _ in range(10):
        next(d)
    assert _ids(next(c)) == _ids(next(d))


def test_dp_sharding_matches_single_rank_global_batch() -> None:
    mbs, num_mb = 2, 3
    gbs = calculate_num_microbatches(12, mbs, 2) * mbs * 2
    ranks = [MicroBatchIterator(_dataset(), mbs, r, 2, seed=3) for r in range(2)]
    single = MicroBatchIterator(_dataset(), mbs, 0, 1, seed=3)
    for _ in range(4):  # 4 iterations, crossing an epoch boundary (48 > 37)
        sharded = [i for it in ranks for _ in range(num_mb) for i in _ids(next(it))]
        whole = [i for _ in range(gbs // mbs) for i in _ids(next(single))]
        assert sorted(sharded) == sorted(whole)
    assert ranks[0].consumed_samples == single.consumed_samples == 48


def test_resume_with_different_dp_size() -> None:
    two = [MicroBatchIterator(_dataset(), 2, r, 2, seed=1) for r in range(2)]
    for it in two:
        for _ in range(3):
            next(it)
    one = MicroBatchIterator(_dataset(), 4, 0, 1, seed=1)
    one.load_state_dict(two[0].state_dict())
    ref = [MicroBatchIterator(_dataset(), 2, r, 2, seed=1, consumed_samples=12) for r in range(2)]
    assert sorted(_ids(next(one))) == sorted(_ids(next(ref[0])) + _ids(next(ref[1])))


def test_exact_epoch_wrap() -> None:
    n = 10
    it = MicroBatchIterator(_dataset(n), 4, 0, 1, seed=5)
    got = [i for _ in range(5) for i in _ids(next(it))]
    perm0 = np.random.default_rng([5, 0]).permutation(n).tolist()
    perm1 = np.random.default_rng([5, 1]).permutation(n).tolist()
    assert got == perm0 + perm1
    assert sorted(got[:n]) == list(range(n)) and perm0 != perm1


def test_load_state_dict_rejects_mismatch() -> None:
    it = MicroBatchIterator(_dataset(), 4, 0, 1, seed=1)
    with pytest.raises(ValueError, match="seed"):
        it.load_state_dict({**it.state_dict(), "seed": 2})
    with pytest.raises(ValueError, match="dataset_len"):
        it.load_state_dict({**it.state_dict(), "dataset_len": 5})
    with pytest.raises(ValueError, match="shuffle"):
        it.load_state_dict({**it.state_dict(), "shuffle": False})


def test_eval_iterator_restarts() -> None:
    valid = _dataset(5)
    first = [_ids(b) for b in make_eval_iterator(valid, 2, 1, 2, num_microbatches=3)]
    second = [_ids(b) for b in make_eval_iterator(valid, 2, 1, 2, num_microbatches=3)]
    assert first == second == [[2, 3], [1, 2], [0, 1]]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ((10, 4, 1), "--global-batch-size"),
        ((0, 4, 1), "--global-batch-size"),
        ((8, 0, 1), "--micro-batch-size"),
        ((8, 4, 0), "data-parallel size"),
    ],
)
def test_calculate_num_microbatches(args: tuple[int, int, int], flag: str) -> None:
    assert calculate_num_microbatches(16, 2, 2) == 4
    with pytest.raises(ValueError, match=flag):
        calculate_num_microbatches(*args)


def test_bad_iterator_args() -> None:
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MicroBatchIterator(_dataset(), 0, 0, 1, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        MicroBatchIterator(_dataset(), 1, 2, 2, seed=0)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunked_iteration_is_the_same_stream(chunk: int) -> None:
    """An iteration's micro-batches built at once (one buffer; views of it) are the same values,
    shapes and dtypes, across epochs, ranks and a resume in the middle of a chunk."""
    for rank in (0, 1):
        plain = MicroBatchIterator(_dataset(), 3, rank, 2, seed=4)
        chunked = MicroBatchIterator(_dataset(), 3, rank, 2, seed=4, chunk_microbatches=chunk)
        for step in range(30):  # 180 samples: several epochs of 37
            a, b = next(plain), next(chunked)
            for key in ("input_ids", "labels"):
                assert torch.equal(a[key], b[key]) and b[key].is_contiguous()
                assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape)
            if step == 7:  # resume both at the plain one's position (mid-chunk)
                state = plain.state_dict(unconsumed_microbatches=1)
                plain.load_state_dict(state)
                chunked.load_state_dict(state)
        assert plain.state_dict() == chunked.state_dict()


def test_a_chunk_is_one_buffer() -> None:
    it = MicroBatchIterator(_dataset(), 4, 0, 1, seed=1, chunk_microbatches=3)
    batches = [next(it) for _ in range(3)]
    storages = {t.untyped_storage().data_ptr() for b in batches for t in b.values()}
    assert len(storages) == 1 and it.consumed_samples == 12
    assert batches[0]["input_ids"].untyped_storage().nbytes() == 2 * 3 * 4 * SEQ * 8
    assert next(it)["input_ids"].untyped_storage().data_ptr() not in storages  # the next chunk
    with pytest.raises(ValueError, match="chunk_microbatches"):
        MicroBatchIterator(_dataset(), 4, 0, 1, seed=1, chunk_microbatches=0)


def test_windows_gather_checks_the_range() -> None:
    ds = _dataset(5)
    assert np.array_equal(ds.windows(np.array([4, 0])), np.stack([ds.window(4), ds.window(0)]))
    with pytest.raises(IndexError, match="sample index 5"):
        ds.windows(np.array([1, 5]))
