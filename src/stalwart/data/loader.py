"""Micro-batches produced ahead of use by DataLoader worker processes (``--num-workers``).

`WorkerMicroBatchIterator` wraps a `MicroBatchIterator` and keeps its contract exactly: the same
batches in the same order, and ``consumed_samples`` / ``state_dict`` describe what the *training
loop* has taken, never what the workers have read ahead. A checkpoint written with workers
resumes without them (and vice versa) on the same samples.

Workers read positions, not a shared cursor: item ``c`` of the worker-side dataset is this rank's
micro-batch of the step that starts at ``c`` consumed samples (`MicroBatchIterator.batch_at`, a
pure function), and the sampler enumerates ``c, c + step, c + 2*step, ...``. Rewinding
(``load_state_dict``, a restart) drops the read-ahead and starts fresh workers at the new
position. Usage in a hand-written loop::

    source = MicroBatchIterator(dataset, mbs, dp_rank, dp_size, seed=1234)
    batches = WorkerMicroBatchIterator(source, num_workers=2,
                                       worker_init_fn=DataLoaderWorkerSignalGuard())
    for _ in range(num_microbatches):
        batch = next(batches)
    ...
    batches.close()
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from stalwart.data.sampler import MicroBatchIterator


class _MicroBatchAt(Dataset[dict[str, torch.Tensor]]):
    """Item ``c``: this rank's micro-batch of the step starting at ``c`` consumed samples."""

    def __init__(self, source: MicroBatchIterator) -> None:
        self.source = source

    def __getitem__(self, consumed: int) -> dict[str, torch.Tensor]:
        return self.source.batch_at(consumed)


class _Positions(Sampler[int]):
    """``start, start + step, ...`` forever (training draws as many micro-batches as it needs)."""

    def __init__(self, start: int, step: int) -> None:
        self.start, self.step = start, step

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start, self.step)


class WorkerMicroBatchIterator:
    """`MicroBatchIterator`'s contract with ``num_workers`` processes reading ahead.

    Args:
        source: defines the order and holds the dataset; its own position is not used after
            construction (``consumed_samples`` here is the truth). Give it ``pin_memory=False``;
            pinning happens in this process (``pin_memory``), as workers cannot pin.
        num_workers: worker processes (>= 1).
        pin_memory: pin batches in the main process (accelerator runs).
        worker_init_fn: e.g. `stalwart.reliability.signals.DataLoaderWorkerSignalGuard`, so that
            a job-wide SIGTERM does not reach the workers' inherited handlers.

    Call `close` (or drop the object) to stop the workers; an in-process restart does so and
    builds a new one.
    """

    def __init__(
        self,
        source: MicroBatchIterator,
        num_workers: int,
        *,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"--num-workers must be an integer >= 1 here, got {num_workers!r}")
        self.source = source
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.worker_init_fn = worker_init_fn
        self._consumed = source.consumed_samples
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def consumed_samples(self) -> int:
        """Global samples the loop has taken (read-ahead excluded)."""
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.source.consumed_samples = value  # validates
        if value != self._consumed:
            self.close()  # the read-ahead belongs to the old position
        self._consumed = value

    def _start(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = DataLoader(
            _MicroBatchAt(self.source),
            batch_size=None,  # items are whole micro-batches already
            sampler=_Positions(self._consumed, self.source.samples_per_micro_batch_step),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            worker_init_fn=self.worker_init_fn,
        )
        return iter(loader)

    def __iter__(self) -> WorkerMicroBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            self._batches = self._start()
        batch = next(self._batches)
        self._consumed += self.source.samples_per_micro_batch_step
        return batch

    def state_dict(self, unconsumed_microbatches: int = 0) -> dict[str, Any]:
        """As `MicroBatchIterator.state_dict`, at the loop's position."""
        consumed = (
            self._consumed - unconsumed_microbatches * self.source.samples_per_micro_batch_step
        )
        return {**self.source.state_dict(), "consumed_samples": consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As `MicroBatchIterator.load_state_dict` (same checks); restarts the workers there."""
        self.source.load_state_dict(state)
        self.consumed_samples = state["consumed_samples"]

    def close(self) -> None:
        """Stop the workers (idempotent); the next ``next()`` starts new ones."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # at once, rather than whenever the iterator is garbage-collected
