"""Resumable, deterministic, data-parallel-sharded micro-batch iteration.

Global order: epoch ``e`` visits the dataset in order
``np.random.default_rng([seed, e]).permutation(N)`` (or identity without shuffling); global
sample ``g`` (counted across epochs) is element ``g % N`` of epoch ``g // N``'s order. With
``c`` global samples consumed, the next micro-batch of DP rank ``r`` holds global samples
``c + r*mbs ... c + (r+1)*mbs - 1`` and consuming it advances ``c`` by ``mbs * dp_size``.
Hence micro-batch ``m`` of an iteration starting at ``c`` holds ``c + (m*dp + r)*mbs + j``, and a
global batch of ``G`` samples is always the global range ``[c, c + G)`` whatever ``dp_size`` is:
a checkpoint written with 2 ranks resumes with 1 rank on exactly the same data.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from stalwart.data.blend import SampleSource


def calculate_num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """``global_batch_size // (micro_batch_size * dp_size)``; ``ValueError`` unless exact."""
    for flag, value in (
        ("--global-batch-size", global_batch_size),
        ("--micro-batch-size", micro_batch_size),
        ("data-parallel size", dp_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step != 0:
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) must be divisible by --micro-batch-size "
            f"({micro_batch_size}) x data-parallel size ({dp_size}) = {per_step}"
        )
    return global_batch_size // per_step


class MicroBatchIterator:
    """Infinite iterator of ``{"input_ids", "labels"}`` int64 CPU tensors ``[mbs, seq]``.

    The only progress state is ``consumed_samples`` (global samples consumed by all DP ranks);
    see the module docstring for the exact order. ``pin_memory=True`` pins each batch (needs an
    accelerator build of torch).

    ``chunk_microbatches`` (the trainer: the iteration's micro-batch count): build that many
    micro-batches at once when the next one is not built yet (`batches_at`): one gather of their
    windows and one pinned buffer holding all their inputs and labels, of which each micro-batch's
    tensors are contiguous views, so a graph's static inputs load a whole iteration with one
    host-to-device copy (``stalwart.graphs.StaticInputs``). The batches and the state are the
    same as with ``1`` (one micro-batch built per ``next``); only the built-ahead part of a chunk
    is not yet consumed.
    """

    def __init__(
        self,
        dataset: SampleSource,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        consumed_samples: int = 0,
        pin_memory: bool = False,
        chunk_microbatches: int = 1,
    ) -> None:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
            raise ValueError(f"--micro-batch-size must be an integer, got {micro_batch_size!r}")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}"
            )
        if len(dataset) < 1:
            raise ValueError("--seq-length: dataset has no samples")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        if isinstance(chunk_microbatches, bool) or not isinstance(chunk_microbatches, int):
            raise ValueError(f"chunk_microbatches must be an integer, got {chunk_microbatches!r}")
        if chunk_microbatches < 1:
            raise ValueError(f"chunk_microbatches must be >= 1, got {chunk_microbatches}")
        self.pin_memory = pin_memory
        self.chunk_microbatches = chunk_microbatches
        self._chunk: tuple[int, list[dict[str, torch.Tensor]]] | None = None  # (start, batches)
        self._consumed = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        self.consumed_samples = consumed_samples

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed so far by all DP ranks together."""
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"consumed_samples must be an integer >= 0, got {value!r}")
        self._consumed = value

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                order = np.arange(n)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def global_sample_index(self, g: int) -> int:
        """Dataset index of global sample ``g`` (counting across epochs)."""
        n = len(self.dataset)
        return int(self._epoch_order(g // n)[g % n])

    @property
    def samples_per_micro_batch_step(self) -> int:
        """Global samples one micro-batch step consumes (all DP ranks together)."""
        return self.micro_batch_size * self.dp_size

    def indices_at(self, consumed: int) -> list[int]:
        """Dataset indices of this rank's micro-batch of the step that starts at ``consumed``."""
        start = consumed + self.dp_rank * self.micro_batch_size
        return [self.global_sample_index(start + j) for j in range(self.micro_batch_size)]

    def batch_at(self, consumed: int) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the step starting at ``consumed`` (pure: no state change,
        so data-loader workers can produce any position ahead of time)."""
        windows = np.stack([self.dataset.window(i) for i in self.indices_at(consumed)])
        batch = torch.from_numpy(windows)
        out = {"input_ids": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()}
        if self.pin_memory:
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    def batches_at(self, consumed: int, count: int) -> list[dict[str, torch.Tensor]]:
        """``[batch_at(consumed + m * step) for m in range(count)]`` (equal values, shapes and
        dtypes), built at once: the tensors of all ``count`` micro-batches are contiguous views
        of one (pinned) buffer, the inputs of every micro-batch, then their labels. Pure, as
        `batch_at`."""
        mbs, step = self.micro_batch_size, self.samples_per_micro_batch_step
        starts = consumed + self.dp_rank * mbs + step * np.arange(count, dtype=np.int64)
        samples = (starts[:, None] + np.arange(mbs, dtype=np.int64)).reshape(-1)
        windows = self._windows(self._dataset_indices(samples))  # [count * mbs, seq + 1]
        seq = windows.shape[1] - 1
        buffer = torch.empty((2 * count, mbs, seq), dtype=torch.int64, pin_memory=self.pin_memory)
        # Filled through NumPy (no torch op per slice); inputs first, then the labels.
        host = buffer.numpy().reshape(2, count * mbs, seq)
        host[0] = windows[:, :-1]
        host[1] = windows[:, 1:]
        views = buffer.unbind(0)
        return [
            {"input_ids": i, "labels": t} for i, t in zip(views[:count], views[count:], strict=True)
        ]

    def _dataset_indices(self, samples: np.ndarray) -> np.ndarray:
        """`global_sample_index` of every global sample in ``samples`` (vectorised per epoch)."""
        n = len(self.dataset)
        first = int(samples.min()) // n
        if int(samples.max()) // n == first:  # the usual case: one epoch
            return self._epoch_order(first)[samples - first * n]
        epochs = samples // n
        out = np.empty_like(samples)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._epoch_order(int(epoch))[samples[where] % n]
        return out

    def _windows(self, indices: np.ndarray) -> np.ndarray:
        """The int64 windows of dataset ``indices``, ``[len(indices), seq + 1]``."""
        gather = getattr(self.dataset, "windows", None)
        if callable(gather):
            return np.asarray(gather(indices), dtype=np.int64)
        return np.stack([self.dataset.window(int(i)) for i in indices])

    def __iter__(self) -> MicroBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step = self.samples_per_micro_batch_step
        if self.chunk_microbatches == 1:
            out = self.batch_at(self._consumed)
        else:
            out = self._from_chunk(self._consumed, step)
        self._consumed += step
        return out

    def _from_chunk(self, consumed: int, step: int) -> dict[str, torch.Tensor]:
        """The micro-batch at ``consumed`` from the built chunk, building the next one when it
        does not hold it (a moved position, e.g. a resume, simply misses)."""
        if self._chunk is not None:
            start, batches = self._chunk
            index, rest = divmod(consumed - start, step)
            if rest == 0 and 0 <= index < len(batches):
                if index == len(batches) - 1:
                    self._chunk = None  # served whole: the buffer lives on in the batches only
                return batches[index]
        batches = self.batches_at(consumed, self.chunk_microbatches)
        self._chunk = (consumed, batches)
        return batches[0]

    def state_dict(self, unconsumed_microbatches: int = 0) -> dict[str, Any]:
        """Checkpointable state; only ``consumed_samples`` is progress, the rest is validated.

        ``unconsumed_microbatches``: describe the state as if the last ``n`` micro-batches had
        not been read (the loop read them for an iteration it has not accepted yet).
        """
        consumed = self._consumed - unconsumed_microbatches * self.samples_per_micro_batch_step
        return {
            "consumed_samples": consumed,
            "seed": self.seed,
            "dataset_len": len(self.dataset),
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
            "shuffle": self.shuffle,
            # Blends: weights and source lengths (None for a single source).
            "dataset_identity": _lists(getattr(self.dataset, "identity", None)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; a different ``dp_size``/``micro_batch_size`` is accepted.

        Raises ``ValueError`` if the seed, dataset length or shuffle flag differ, since the
        sample order would then silently change.
        """
        checks = (("seed", self.seed, "--seed"), ("dataset_len", len(self.dataset), "--data-path"))
        for key, mine, flag in checks:
            if state.get(key) != mine:
                raise ValueError(
                    f"data iterator checkpoint has {key}={state.get(key)!r} but this run has "
                    f"{mine!r}; resuming would change the sample order (check {flag})"
                )
        mine_identity = _lists(getattr(self.dataset, "identity", None))
        if "dataset_identity" in state and state["dataset_identity"] != mine_identity:
            raise ValueError(
                "data iterator checkpoint was written for the data blend "
                f"{_describe_blend(state['dataset_identity'])} but this run reads "
                f"{_describe_blend(mine_identity)}; resuming would change the sample order "
                "(check the weights and paths of --data-path)"
            )
        if "shuffle" in state and state["shuffle"] != self.shuffle:
            raise ValueError(
                f"data iterator checkpoint has shuffle={state['shuffle']!r} but this run has "
                f"{self.shuffle!r}"
            )
        self.consumed_samples = state["consumed_samples"]


def _lists(value: Any) -> Any:
    """Tuples as lists (checkpoint state is JSON-friendly, and compares equal after a load)."""
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


def _describe_blend(identity: Any) -> str:
    if not identity:
        return "of one source"
    return ", ".join(f"{w:g} x {int(n)} samples" for w, n in identity)


def make_eval_iterator(
    valid: SampleSource,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_microbatches: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Fresh validation iterator starting at sample 0, in dataset order, cycling forever.

    Call it again for every evaluation so each one sees the same samples. With
    ``num_microbatches`` the iterator stops after that many micro-batches for this rank.
    """
    it = MicroBatchIterator(valid, micro_batch_size, dp_rank, dp_size, seed=0, shuffle=False)
    if num_microbatches is None:
        return it
    if num_microbatches < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {num_microbatches}")
    return itertools.islice(it, num_microbatches)
