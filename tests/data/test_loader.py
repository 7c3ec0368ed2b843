"""`WorkerMicroBatchIterator`: worker processes read ahead, the order and the state do not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stalwart.data import MicroBatchIterator, TokenDataset, WorkerMicroBatchIterator
from stalwart.reliability.signals import DataLoaderWorkerSignalGuard

SEQ, MBS = 8, 3


def _dataset() -> TokenDataset:
    # 11 samples: 4 micro-batch steps of 2 ranks x 3 samples cross an epoch boundary.
    return TokenDataset(np.arange(11 * SEQ + 1, dtype=np.int64) % 97, SEQ)


def _source(rank: int = 1, consumed: int = 0) -> MicroBatchIterator:
    return MicroBatchIterator(_dataset(), MBS, rank, 2, seed=3, consumed_samples=consumed)


def _take(it, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_workers_give_the_same_batches_and_state_as_the_plain_iterator() -> None:
    plain = _source(consumed=12)
    workers = WorkerMicroBatchIterator(
        _source(consumed=12), 2, worker_init_fn=DataLoaderWorkerSignalGuard()
    )
    try:
        _same(_take(workers, 5), _take(plain, 5))  # crosses epochs 1 -> 2 -> 3 (11 samples each)
        # The workers have read ahead, the state has not: it is what the loop has taken.
        assert workers.consumed_samples == plain.consumed_samples == 12 + 5 * 6
        assert workers.state_dict() == plain.state_dict()
    finally:
        workers.close()


def test_load_state_dict_rewinds_and_restarts_the_workers() -> None:
    workers = WorkerMicroBatchIterator(_source(), 2)
    try:
        first = _take(workers, 4)
        saved = workers.state_dict()
        later = _take(workers, 3)
        workers.load_state_dict({**saved, "consumed_samples": 6})  # back to step 1
        _same(_take(workers, 3), first[1:])
        workers.load_state_dict(saved)
        _same(_take(workers, 3), later)
        workers.close()
        workers.close()  # idempotent; the next batch starts new workers where the loop is
        _same(_take(workers, 1), _take(_source(consumed=saved["consumed_samples"] + 18), 1))
    finally:
        workers.close()


def test_a_checkpoint_with_another_seed_is_refused() -> None:
    workers = WorkerMicroBatchIterator(_source(), 1)
    with pytest.raises(ValueError, match="--seed"):
        workers.load_state_dict({**workers.state_dict(), "seed": 4})


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_num_workers(bad) -> None:
    with pytest.raises(ValueError, match="--num-workers"):
        WorkerMicroBatchIterator(_source(), bad)
