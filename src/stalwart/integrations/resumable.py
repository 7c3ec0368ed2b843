"""A data loader that a framework can checkpoint mid-epoch: its position, not its contents.

Lightning saves the ``state_dict()`` of a training loader that has one and loads it on resume;
a plain ``DataLoader`` has none, so a mid-epoch resume starts the epoch over ("your dataloader
is not resumable") and the run is no longer the uninterrupted one. :class:`ResumableLoader`
wraps any re-iterable loader and keeps ``{"epoch", "batch"}``: how many passes are complete and
how many batches of the current one were handed out. After :meth:`load_state_dict` the next pass
skips that many batches (they are drawn and dropped: the loader's own order decides what comes
next, so the resume is exact when that order is a function of the epoch, e.g. ``shuffle=False``,
a ``DistributedSampler`` whose ``set_epoch`` the framework calls, or a sampler seeded per epoch).

Under data parallelism each rank needs its shard: the Lightning callback inserts Lightning's
``DistributedSampler`` into the wrapped ``DataLoader`` as Lightning does for a bare one
(``use_distributed_sampler``), and Lightning calls its ``set_epoch`` through :attr:`sampler`.

Usage::

    >>> import torch
    >>> from stalwart.integrations.resumable import ResumableLoader
    >>> loader = ResumableLoader(torch.utils.data.DataLoader(torch.arange(10), batch_size=2))
    >>> it = iter(loader); [next(it).tolist() for _ in range(2)]
    [[0, 1], [2, 3]]
    >>> state = loader.state_dict(); state
    {'epoch': 0, 'batch': 2}
    >>> resumed = ResumableLoader(torch.utils.data.DataLoader(torch.arange(10), batch_size=2))
    >>> resumed.load_state_dict(state)
    >>> [b.tolist() for b in resumed]
    [[4, 5], [6, 7], [8, 9]]
    >>> len(resumed)                                  # the whole pass, as the framework counts
    5
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["ResumableLoader"]


class ResumableLoader:
    """Wraps ``loader`` (re-iterable: each ``iter()`` is one pass); see the module docstring."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.epoch = 0
        self.batch = 0
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def sampler(self) -> Any:
        """The wrapped loader's sampler (a framework calls its ``set_epoch`` every epoch)."""
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        """The wrapped loader's batch sampler (its ``sampler``'s ``set_epoch``, as above)."""
        return getattr(self.loader, "batch_sampler", None)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self.batch = 0
        for index, item in enumerate(self.loader):
            if index < skip:
                continue
            self.batch = index + 1
            yield item
        self.epoch += 1
        self.batch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, batch = state.get("epoch"), state.get("batch")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, batch)
        ):
            raise ValueError(
                f"ResumableLoader.load_state_dict: epoch and batch must be integers >= 0, "
                f"got {state!r}"
            )
        assert isinstance(epoch, int) and isinstance(batch, int)
        self.epoch, self.batch, self._skip = epoch, batch, batch
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
