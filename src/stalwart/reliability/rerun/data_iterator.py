"""A data iterator that can replay the micro-batches of the current iteration."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RerunDataIterator(Generic[T]):
    """Wraps an iterable; remembers what one iteration consumed so a rerun sees the same data.

    The state machine calls :meth:`advance` when a new iteration starts (drops the buffer) and
    :meth:`rewind` before a rerun (replays the buffer from the start). Each buffered item is a
    shallow copy, so a consumer that mutates a batch dict does not corrupt the replay.

    :meth:`peek` reads the *next* iteration's items ahead (for a speculative launch of its
    forward-backward): after the next :meth:`advance` the same objects are served first, and
    recorded as usual; a rerun of the current iteration does not see them.

    Args:
        iterable: any iterable (``iter()`` is applied) or iterator.
        record: when False, nothing is buffered (for a machine in ``disabled`` mode).
    """

    def __init__(self, iterable: Iterable[T], *, record: bool = True) -> None:
        self.iterable: Iterator[T] = iter(iterable)
        self.record = record
        self.saved_microbatches: list[T] = []
        self.replaying = False
        self.replay_pos = 0
        self._ahead: list[T] = []  # read by peek(), for the next iteration
        self._prefetched: list[T] = []  # this iteration's items read ahead by peek()

    def __iter__(self) -> RerunDataIterator[T]:
        return self

    def __next__(self) -> T:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError(
                    "RerunDataIterator: no more batches to replay; the rerun consumed more "
                    "micro-batches than the initial run (control flow must be deterministic)"
                )
            item = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return item
        item = self._prefetched.pop(0) if self._prefetched else next(self.iterable)
        if self.record:
            self.saved_microbatches.append(copy.copy(item))
        return item

    def rewind(self) -> None:
        """Replay this iteration's micro-batches from the first one."""
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        """Start a new iteration: stop replaying and drop the buffer; peeked items come next."""
        self.replaying = False
        self.replay_pos = 0
        self.saved_microbatches = []
        self._prefetched, self._ahead = self._prefetched + self._ahead, []

    def peek(self, count: int) -> list[T]:
        """The next iteration's first ``count`` items, read ahead: after :meth:`advance` the
        same objects are served first. Call once the current iteration has read its items."""
        self._ahead, self._prefetched = self._prefetched + self._ahead, []
        while len(self._ahead) < count:
            self._ahead.append(next(self.iterable))
        return self._ahead[:count]

    def state_dict(self) -> dict[str, Any]:
        """The replay buffer and position (not the underlying iterator's position)."""
        return {
            "saved_microbatches": list(self.saved_microbatches),
            "replaying": self.replaying,
            "replay_pos": self.replay_pos,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.saved_microbatches = list(sd["saved_microbatches"])
        self.replaying = bool(sd["replaying"])
        self.replay_pos = int(sd["replay_pos"])
