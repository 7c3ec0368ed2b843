"""The pass begun ahead (look-ahead launch): the next iteration's initial pass, begun before
this pass was read, and adopted by that iteration when this pass is accepted."""

from __future__ import annotations

from stalwart.reliability.rerun.checks.recorder import Recorder
from stalwart.reliability.rerun.passes import Records, Saved, StateSaver


class AheadPass:
    """Owns the pass begun ahead, if any: its iteration, the state saved when it began (before
    any of its work, so exactly what the machine would have saved at the start of that
    iteration) and its records.

    Args:
        recorder: the machine's recorder (records go to the pass begun ahead while it runs).
        saver: saves the state to restore for it, and restores it when it is dropped.
    """

    def __init__(self, recorder: Recorder, saver: StateSaver) -> None:
        self._recorder = recorder
        self._saver = saver
        self.iteration: int | None = None  # the iteration begun ahead, if any
        self._saved: Saved | None = None
        self._records = Records()

    @property
    def pending(self) -> bool:
        return self.iteration is not None

    def begin(self, iteration: int) -> None:
        """Begin ``iteration``'s initial pass now (``RerunStateMachine.begin_ahead``): save its
        state, freeze this pass's buffer values for the coming read, clear the buffers for it."""
        self._saved = self._saver.capture()
        for buffer in self._recorder.buffers:
            buffer.snapshot()
            buffer.begin_ahead()
        self.iteration, self._records = int(iteration), Records()
        self._recorder.records = self._records

    def take(self, iteration: int) -> tuple[Saved, Records] | None:
        """The saved state and records of the pass begun ahead when it is ``iteration``'s (it
        is no longer pending then); one begun for another iteration stays (drop it with
        :meth:`discard`)."""
        if self.iteration is None or self.iteration != iteration or self._saved is None:
            return None
        taken = (self._saved, self._records)
        self.iteration, self._saved = None, None
        return taken

    def discard(self, restore_rng: bool = True) -> bool:
        """Drop the pass begun ahead: its records and large-value updates are undone and, with
        ``restore_rng``, every RNG is put back. Returns whether there was one."""
        saved, self.iteration, self._saved = self._saved, None, None
        if saved is None:
            return False
        recorder = self._recorder
        recorder.records = recorder.reading
        for buffer in recorder.buffers:
            buffer.drop_ahead()
        recorder.restore_trackers(saved.trackers)
        if restore_rng:
            self._saver.restore_rng(saved)
        return True
