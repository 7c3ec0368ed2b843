"""What the Lightning callback checks and arranges before training: each data-parallel rank
trains on its own shard of a :class:`~stalwart.integrations.resumable.ResumableLoader`, and a
module the guarded step cannot drive is refused in one line (instead of a run that never ends).

Lightning inserts a ``DistributedSampler`` only into a ``DataLoader`` it is given
(``use_distributed_sampler``); a :class:`ResumableLoader` wraps one, so Lightning would leave it
alone and every rank would train on the same batches. :func:`shard_resumable_loaders` gives the
wrapped ``DataLoader`` the sampler Lightning would have inserted (Lightning's own
``_prepare_dataloader``: the same shuffle, seed and ``distributed_sampler_kwargs``), before
Lightning measures the loader's length; Lightning then calls its ``set_epoch`` every epoch
through ``ResumableLoader.sampler``, and a mid-epoch resume skips the consumed batches of the same
order (the sampler's order is a function of its seed and epoch). A loader Lightning builds later
(``train_dataloader()`` of the module or a data module) cannot be reached before its length is
taken: :func:`refuse_unsharded` stops that run in one line at ``on_train_start``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from stalwart.integrations.resumable import ResumableLoader


def _resumables(loaders: Any) -> Iterator[ResumableLoader]:
    """The :class:`ResumableLoader` s among ``loaders`` (one, or a list/tuple/dict of them)."""
    if isinstance(loaders, ResumableLoader):
        yield loaders
    elif isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from _resumables(value)
    elif isinstance(loaders, list | tuple):
        for value in loaders:
            yield from _resumables(value)


def _distributed(loader: Any) -> bool:
    samplers = (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    )
    return any(isinstance(s, DistributedSampler) for s in samplers)


def shard_resumable_loaders(trainer: Any) -> None:
    """Give every :class:`ResumableLoader` passed to ``trainer.fit`` the sampler Lightning
    inserts into a bare ``DataLoader`` (call before Lightning sets up the training data)."""
    if trainer.world_size <= 1:
        return
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled

    connector = trainer._data_connector  # Lightning's own insertion, not a copy of it
    for resumable in _resumables(trainer.fit_loop._data_source.instance):
        inner = resumable.loader
        if isinstance(inner, DataLoader) and not _distributed(inner):
            resumable.loader = connector._prepare_dataloader(
                inner, shuffle=_is_dataloader_shuffled(inner), mode=RunningStage.TRAINING
            )


def refuse_unsharded(trainer: Any) -> None:
    """Raise (one line) when, under several ranks with ``use_distributed_sampler``, a
    :class:`ResumableLoader` still wraps a ``DataLoader`` without a distributed sampler."""
    if trainer.world_size <= 1 or not trainer._accelerator_connector.use_distributed_sampler:
        return
    for resumable in _resumables(trainer.train_dataloader):
        inner = resumable.loader
        iterable = isinstance(getattr(inner, "dataset", None), IterableDataset)  # as Lightning
        if isinstance(inner, DataLoader) and not iterable and not _distributed(inner):
            raise ValueError(
                f"ResumableLoader under {trainer.world_size} ranks: its DataLoader has no "
                "DistributedSampler, so every rank would train on the same batches; pass the "
                "loader to trainer.fit(...) (the callback shards it) or give the DataLoader a "
                "DistributedSampler"
            )


@contextlib.contextmanager
def as_before_the_batch(trainer: Any) -> Iterator[None]:
    """While Lightning saves at the end of a rejected batch: its epoch loop's counters and the
    :class:`ResumableLoader` s' positions as they were before that batch (as a save at the
    previous batch's end holds them), so a resume is handed the rejected batch again instead of
    the one after it. Put back afterwards."""
    loop = trainer.fit_loop.epoch_loop
    progress = (loop.batch_progress.total, loop.batch_progress.current)
    names = ("ready", "started", "processed", "completed")
    counters = [(tracker, name, getattr(tracker, name)) for tracker in progress for name in names]
    loaders = [r for r in _resumables(trainer.train_dataloader) if r.batch > 0]
    stepped = loop._batches_that_stepped  # incremented after the batch's end: one batch less
    last = loop.batch_progress.is_last_batch  # the epoch's last batch: not the one before it
    for tracker, name, value in counters:
        setattr(tracker, name, value - 1)
    for loader in loaders:
        loader.batch -= 1
    loop._batches_that_stepped, loop.batch_progress.is_last_batch = stepped - 1, False
    try:
        yield
    finally:
        for tracker, name, value in counters:
            setattr(tracker, name, value)
        for loader in loaders:
            loader.batch += 1
        loop._batches_that_stepped, loop.batch_progress.is_last_batch = stepped, last


def refuse_unguardable(module: Any, optimizers: Any) -> None:
    """Raise (one line) for a ``GuardedModule`` the guarded step cannot drive: one that keeps
    its own ``training_step`` (manual optimization with no optimizer step never reaches
    ``max_steps``) or one with several optimizers (the step drives one)."""
    from stalwart.integrations.lightning_module import GuardedModule

    name = type(module).__name__
    if type(module).training_step is not GuardedModule.training_step:
        raise TypeError(
            f"{name} defines training_step: a GuardedModule implements forward_step(batch) -> "
            "loss instead (the guarded step runs the backward and the optimizer step); rename it"
        )
    if isinstance(optimizers, list | tuple):
        raise ValueError(
            f"{name}.configure_optimizers returned {len(optimizers)} optimizers: the guarded "
            "step drives one; put the parameter groups in one optimizer"
        )


__all__ = [
    "as_before_the_batch",
    "refuse_unguardable",
    "refuse_unsharded",
    "shard_resumable_loaders",
]
