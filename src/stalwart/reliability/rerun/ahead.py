"""The pass begun ahead (look-ahead launch) and the device-gated step, for the rerun machine.

Split from ``machine.py`` to keep files small; mixed into ``RerunStateMachine``.
"""

from __future__ import annotations

from stalwart.reliability.rerun.core import MachineCore
from stalwart.reliability.rerun.passes import Ahead, Saved
from stalwart.reliability.rerun.rng import capture_rng_state, restore_rng_state


class AheadMixin(MachineCore):
    """Look-ahead support (a part of the machine: ``core.MachineCore``)."""

    def can_gate_step(self) -> bool:
        """Whether the optimizer step may be enqueued before this pass is read, gated on the
        device: an initial pass (not determinism stats) whose every check has a device verdict
        (the gate then rejects exactly when the read will)."""
        return (
            self.allows_step_before_validation()
            and not self._reading.host_evaluated
            and all(b.device_evaluable for b in self._buffers)
        )

    def can_begin_ahead(self) -> bool:
        """Whether the next iteration may begin before this pass is read: a gateable pass, none
        begun ahead yet, no error injection (it decides per pass as a pass begins)."""
        return self.can_gate_step() and self._ahead is None and not self.injector.enabled

    def begin_ahead(self, iteration: int) -> None:
        """Begin ``iteration``'s initial pass now, before this pass is read (look-ahead launch).

        Saves the state to restore for it (captured now, before any of its work), freezes this
        pass's buffer values for the coming read (stream-ordered copy) and clears the buffers for
        the next pass; records go to that pass from now on. The read then evaluates this pass;
        a rejection drops the pass begun ahead, an acceptance lets the next iteration adopt it.
        """
        if not self.can_begin_ahead():
            raise RuntimeError("begin_ahead() needs an initial pass with device verdicts only")
        saved = self._capture_saved()
        for buffer in self._buffers:
            buffer.snapshot()
            buffer.begin_ahead()
        self._ahead = Ahead(int(iteration), saved)
        self._records = self._ahead.records

    @property
    def ahead_iteration(self) -> int | None:
        """The iteration begun ahead, if any."""
        return None if self._ahead is None else self._ahead.iteration

    def discard_ahead(self, restore_rng: bool = True) -> bool:
        """Drop the pass begun ahead (its work ran on stale state or must rerun): its records and
        large-value updates are undone, and, with ``restore_rng``, every RNG is put back to what
        it was when it began. Returns whether there was one."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        self._records = self._reading
        for buffer in self._buffers:
            buffer.drop_ahead()
        if self._buffer is not None:
            self._buffer.restore_trackers(ahead.saved.trackers)
        if restore_rng:
            restore_rng_state(ahead.saved.rng, self.rng)
        return True

    def _capture_saved(self) -> Saved:
        extra = self.state_save_func() if self.state_save_func is not None else None
        trackers = self._buffer.save_trackers() if self._buffer is not None else {}
        return Saved(capture_rng_state(self.rng), extra, trackers)
