"""A data iterator that can replay the micro-batches of the current iteration."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RerunDataIterator(Generic[T]):
    """Wraps an iterable; remembers what one iteration consumed so a rerun sees the same data.

    The state machine calls :meth:`advance` when a new iteration starts (drops the buffer),
    :meth:`rewind` before a rerun (replays the buffer from the start) and :meth:`commit` when an
    iteration is accepted. Each buffered item is a shallow copy, so a consumer that mutates a
    batch dict does not corrupt the replay.

    :meth:`peek` reads the *next* iteration's items ahead (for a look-ahead launch of its
    forward-backward): after the next :meth:`advance` the same objects are served first, and
    recorded as usual; a rerun of the current iteration does not see them.

    Checkpoint state (:meth:`state_dict`): the position at the start of the first iteration not
    yet accepted, so a checkpoint written while an iteration is being validated (the exit-16
    one) resumes that iteration. When the wrapped iterable is resumable itself (its
    ``state_dict(unconsumed_microbatches=n)`` describes it as if its last ``n`` items had not
    been read, e.g. :class:`stalwart.data.MicroBatchIterator`), its state is saved and loaded;
    otherwise loading skips ``position`` items of a fresh iterable.

    Args:
        iterable: any iterable (``iter()`` is applied) or iterator.
        record: when False, nothing is buffered (for a machine in ``disabled`` mode).
    """

    def __init__(self, iterable: Iterable[T], *, record: bool = True) -> None:
        self.source: Any = iterable
        self.iterable: Iterator[T] = iter(iterable)
        self.record = record
        self.saved_microbatches: list[T] = []
        self.replaying = False
        self.replay_pos = 0
        self._ahead: list[T] = []  # read by peek(), for the next iteration
        self._prefetched: list[T] = []  # this iteration's items read ahead by peek()
        self._pulled = 0  # items taken from the iterable
        self._committed = 0  # items of accepted iterations
        self._current = 0  # items served (first time) in the current iteration
        self._served: list[T] | None = None  # another rank's items, for a peer replay

    def __iter__(self) -> RerunDataIterator[T]:
        return self

    def __next__(self) -> T:
        if self._served is not None:
            overrun = "the peer replay consumed more micro-batches than the replayed rank recorded"
            return self._replayed(self._served, overrun)
        if self.replaying:
            overrun = (
                "no more batches to replay; the rerun consumed more micro-batches than the "
                "initial run"
            )
            return self._replayed(self.saved_microbatches, overrun)
        item = self._prefetched.pop(0) if self._prefetched else self._pull()
        self._current += 1
        if self.record:
            self.saved_microbatches.append(copy.copy(item))
        return item

    def _replayed(self, items: list[T], overrun: str) -> T:
        """The next of ``items`` (a replay); ``overrun`` says what reading past them means."""
        if self.replay_pos >= len(items):
            raise RuntimeError(f"RerunDataIterator: {overrun} (control flow must be deterministic)")
        self.replay_pos += 1
        return items[self.replay_pos - 1]

    def _pull(self) -> T:
        item = next(self.iterable)
        self._pulled += 1
        return item

    def rewind(self) -> None:
        """Replay this iteration's micro-batches from the first one."""
        self.replaying = True
        self.replay_pos = 0
        self._served = None

    def serve(self, items: list[T]) -> None:
        """Serve ``items`` (another rank's recorded micro-batches, for a peer replay) until the
        next :meth:`rewind` or :meth:`advance`; this iteration's own record is kept."""
        self._served = list(items)
        self.replay_pos = 0

    def advance(self) -> None:
        """Start a new iteration: stop replaying and drop the buffer; peeked items come next."""
        self.replaying = False
        self.replay_pos = 0
        self._served = None
        self.saved_microbatches = []
        self._current = 0
        self._prefetched, self._ahead = self._prefetched + self._ahead, []

    def unread(self) -> None:
        """Put this iteration's micro-batches back: they are served first after the next
        :meth:`advance`, as if never read (a spike rewind that skips the iteration in place
        consumes exactly them). Nothing is committed."""
        self._prefetched = self.saved_microbatches + self._prefetched + self._ahead
        self.saved_microbatches, self._ahead = [], []
        self.replaying, self.replay_pos, self._served = False, 0, None
        self._current = 0

    @property
    def rewindable(self) -> bool:
        """Whether :meth:`load_state_dict` can go back to an earlier position: the source is
        resumable (``state_dict``/``load_state_dict``) or a sequence read again from its start.
        A one-shot iterator (or a loader that may shuffle anew) cannot."""
        source = self.source
        resumable = callable(getattr(source, "state_dict", None)) and callable(
            getattr(source, "load_state_dict", None)
        )
        return resumable or isinstance(source, Sequence)

    def commit(self) -> None:
        """The current iteration is accepted: its items count as consumed for checkpoints."""
        self._committed += self._current
        self._current = 0

    @property
    def position(self) -> int:
        """Items of the accepted iterations (where a resumed run starts reading)."""
        return self._committed

    def peek(self, count: int) -> list[T]:
        """The next iteration's first ``count`` items, read ahead: after :meth:`advance` the
        same objects are served first. Call once the current iteration has read its items."""
        self._ahead, self._prefetched = self._prefetched + self._ahead, []
        while len(self._ahead) < count:
            self._ahead.append(self._pull())
        return self._ahead[:count]

    def state_dict(self) -> dict[str, Any]:
        """``{"position": n}`` (+ ``"source"``: the resumable iterable's state at that point)."""
        state: dict[str, Any] = {"position": self._committed}
        source_state = getattr(self.source, "state_dict", None)
        if callable(source_state):
            state["source"] = source_state(unconsumed_microbatches=self._pulled - self._committed)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``: at start-up, or to go back (a spike rewind) when the
        source is :attr:`rewindable` (else ``ValueError``: a one-shot iterator cannot)."""
        position = int(state["position"])
        load = getattr(self.source, "load_state_dict", None)
        if "source" in state and callable(load):
            load(state["source"])
            self.iterable = iter(self.source)
        else:
            if position < self._pulled:
                if not isinstance(self.source, Sequence):
                    raise ValueError(
                        f"RerunDataIterator: cannot go back to item {position} of a one-shot "
                        f"iterator ({self._pulled} read); give a sequence or a resumable source"
                    )
                self.iterable, self._pulled = iter(self.source), 0
            for _ in range(position - self._pulled):
                self._pull()
        self.saved_microbatches, self._ahead, self._prefetched = [], [], []
        self.replaying, self.replay_pos, self._served = False, 0, None
        self._pulled = self._committed = position
        self._current = 0


def wrapped_iterators(data_iterator: Any, required: bool) -> list[RerunDataIterator[Any]]:
    """The :class:`RerunDataIterator` of ``data_iterator`` (one, a list of them, or None; a
    list's None entries are skipped). ``required``: refuse any other iterator (an enabled
    machine must replay what it reads)."""
    if data_iterator is None:
        return []
    if isinstance(data_iterator, int):
        raise TypeError(
            "should_run_forward_backward(data_iterator, iteration=...): pass iteration= by keyword"
        )
    items = data_iterator if isinstance(data_iterator, list | tuple) else [data_iterator]
    out = []
    for it in items:
        if isinstance(it, RerunDataIterator):
            out.append(it)
        elif it is not None and required:
            raise TypeError("data iterator is not wrapped with RerunDataIterator")
    return out
