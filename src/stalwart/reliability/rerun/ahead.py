"""The pass begun ahead (look-ahead launch): the next iteration's initial pass, begun before
this pass was read, and adopted by that iteration when this pass is accepted."""

from __future__ import annotations

from stalwart.reliability.rerun.checks.recorder import Recorder
from stalwart.reliability.rerun.passes import Ahead, StateSaver


class AheadPass:
    """Owns the pass begun ahead, if any.

    Args:
        recorder: the machine's recorder (records go to the pass begun ahead while it runs).
        saver: saves the state to restore for it, and restores it when it is dropped.
    """

    def __init__(self, recorder: Recorder, saver: StateSaver) -> None:
        self._recorder = recorder
        self._saver = saver
        self._ahead: Ahead | None = None

    @property
    def pending(self) -> bool:
        return self._ahead is not None

    @property
    def iteration(self) -> int | None:
        """The iteration begun ahead, if any."""
        return None if self._ahead is None else self._ahead.iteration

    def begin(self, iteration: int) -> None:
        """Begin ``iteration``'s initial pass now (``RerunStateMachine.begin_ahead``): save its
        state, freeze this pass's buffer values for the coming read, clear the buffers for it."""
        saved = self._saver.capture()
        for buffer in self._recorder.buffers:
            buffer.snapshot()
            buffer.begin_ahead()
        self._ahead = Ahead(int(iteration), saved)
        self._recorder.records = self._ahead.records

    def take(self, iteration: int) -> Ahead | None:
        """The pass begun ahead when it is ``iteration``'s (it is no longer pending then);
        one begun for another iteration stays (drop it with :meth:`discard`)."""
        ahead = self._ahead
        if ahead is not None and ahead.iteration == iteration:
            self._ahead = None
            return ahead
        return None

    def discard(self, restore_rng: bool = True) -> bool:
        """Drop the pass begun ahead: its records and large-value updates are undone and, with
        ``restore_rng``, every RNG is put back. Returns whether there was one."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        recorder = self._recorder
        recorder.records = recorder.reading
        for buffer in recorder.buffers:
            buffer.drop_ahead()
        recorder.restore_trackers(ahead.saved.trackers)
        if restore_rng:
            self._saver.restore_rng(ahead.saved)
        return True
