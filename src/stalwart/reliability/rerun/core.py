"""What every part of the rerun state machine shares, declared once: its state, its place in the
process group, its device check buffers and the life cycle of one pass.

``RerunStateMachine`` (``machine.py``: the constructor, the public API and the state transitions)
is composed of parts kept in their own modules: recording (``recording.py``), the pass begun
ahead (``ahead.py``), verdicts, logging and checkpoint state (``verdicts.py``), the peer replay
(``peer_flow.py``) and the replica fingerprints (``replicas.py``). Each part derives from
:class:`MachineCore`: it declares the attributes the machine's constructor sets and the few
methods one part provides to another (so mypy checks every part against one declaration), and
implements what all of them use (ranks, buffers, entering and restoring a pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.reliability.rerun.buffer import DeviceRule, ValidationBuffer, ValidationRecord
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.passes import Ahead, Records, Saved
from stalwart.reliability.rerun.reading import read_values
from stalwart.reliability.rerun.rng import RngStateTracker, restore_rng_state
from stalwart.reliability.rerun.stats import LargeValueTracker, QuickStats
from stalwart.reliability.rerun.tracker import TrackerFile
from stalwart.reliability.rerun.types import (
    CallKey,
    CheckConfig,
    Diagnosis,
    Identity,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    device_identity,
)

if TYPE_CHECKING:
    from stalwart.reliability.rerun.checks import CheckRows
    from stalwart.reliability.rerun.peer import PeerPlan, ReplayDeterminism
    from stalwart.reliability.rerun.replicas import ReplicaGate
    from stalwart.reliability.rerun.verdicts import Event

Items = list[tuple[ValidationRecord, float]]
"""The values of one pass's records, as the read returns them."""

VALIDATE = RerunMode.VALIDATE_RESULTS
_RERUNS = (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT)


class MachineCore:
    """The shared state and pass life cycle of ``RerunStateMachine`` (see the module docstring).

    Not meant to be built alone: ``RerunStateMachine.__init__`` sets every attribute declared
    here. The methods that raise ``NotImplementedError`` are provided by one of the parts.
    """

    REPORTING_INTERVAL_ITERATIONS: int
    # Configuration (set once by the constructor).
    mode: RerunMode
    injector: RerunErrorInjector
    tracker: TrackerFile | None
    state_save_func: Callable[[], Any] | None
    state_restore_func: Callable[[Any], None] | None
    process_group: dist.ProcessGroup | None
    rng: RngStateTracker
    checks: CheckConfig
    device: torch.device | None
    peer_replay: bool
    replay_determinism: ReplayDeterminism
    local_grad_checks: bool
    replicas: ReplicaGate | None
    # The iteration and its passes.
    state: RerunState
    iteration: int
    event: Event | None
    diagnosis: RerunDiagnostic | None
    stats: dict[str, QuickStats]
    last_report: str | None
    last_attribution_seconds: float | None
    _records: Records
    _reading: Records
    _ahead: Ahead | None
    _buffer: ValidationBuffer | None
    _buffers: list[ValidationBuffer]
    _windows_to_load: dict[str, Any]
    _saved: Saved | None
    _saved_results: dict[CallKey, float]
    _large: dict[str, LargeValueTracker]
    _awaiting_exit: bool
    _host_checks: bool
    _check_rows: CheckRows
    # Attribution (peer replay, replica fingerprints).
    _peer_plan: PeerPlan | None
    _pending_diagnosis: Diagnosis | None
    _final_pass: bool
    _rejected_at: float | None
    _replica_originals: list[list[int]] | None
    _replica_detail: str

    # ------------------------------------------------------------------ place in the group
    @property
    def rank(self) -> int:
        return dist.get_rank() if collectives.is_initialized() else 0

    @property
    def group_rank(self) -> int:
        return dist.get_rank(self.process_group) if collectives.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if collectives.is_initialized() else 1

    def _global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the machine's group."""
        if self.process_group is None or not collectives.is_initialized():
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _identity(self) -> Identity:
        return device_identity()

    # ------------------------------------------------------------------------ device buffers
    @property
    def buffer(self) -> ValidationBuffer | None:
        """The machine's one device check buffer (None before the first device check)."""
        return self._buffer

    def check_buffer(self, device: torch.device) -> ValidationBuffer:
        """The device check buffer, created on ``device`` on first use."""
        if self._buffer is None:
            self._buffer = ValidationBuffer(device, name="", may_inject=self.injector.enabled)
            self._buffers.insert(0, self._buffer)
            if self._windows_to_load:
                self._buffer.load_tracker_state(self._windows_to_load)
                self._windows_to_load = {}
        elif self._buffer.device != torch.device(device):
            raise ValueError(
                f"device checks on {device} but the rerun machine's buffer is on "
                f"{self._buffer.device}: record all checks on one device"
            )
        return self._buffer

    def attach_buffer(self, buffer: ValidationBuffer) -> None:
        """Also read ``buffer`` (slots declared with ``add_check``) in the per-iteration sync."""
        self._buffers.append(buffer)

    def _load_device_windows(self, windows: dict[str, Any]) -> None:
        if self._buffer is not None:
            self._buffer.load_tracker_state(windows)
        else:  # applied when the first device check creates the buffer
            self._windows_to_load = dict(windows)

    # --------------------------------------------------------------------- a pass's life cycle
    def _enter(self, state: RerunState) -> None:
        """Start a pass: new state, empty records, buffers cleared with their injection masks."""
        self.state = state
        self._records = self._reading = Records()
        self._begin_buffers(adopt_ahead=False)

    def _begin_buffers(self, adopt_ahead: bool) -> None:
        for buf in self._buffers:
            buf.set_gate_policy(gate_non_fatal=self.mode is VALIDATE)
            buf.begin([self._inject_decision(k) for k in buf.keys], adopt_ahead=adopt_ahead)

    def _inject_decision(self, key: CallKey) -> bool:
        if self.state is RerunState.REPLAYING_ON_PEER:
            return self.mode is VALIDATE and self._peer_corrupts(key)
        if self.mode is not VALIDATE or not self.injector.enabled:
            return False
        if self.state is RerunState.INITIAL_RUN:
            return self.injector.maybe_inject(key, self.iteration, self.rank, self._identity())
        if self.state in _RERUNS:
            return self.injector.should_corrupt(key, self.state, self._identity())
        return False

    def _read(self) -> Items:
        """The values of the pass being read: the iteration's one deliberate host sync."""
        return read_values(self._reading.pending, self._buffers)

    def _begin_rerun(self, iterators: list[RerunDataIterator[Any]]) -> None:
        self.discard_ahead(restore_rng=False)  # the rerun restores this iteration's own state
        self._restore_state()
        for it in iterators:
            it.rewind()
        self._enter(RerunState.RERUNNING_IN_PLACE)

    def _restore_state(self) -> None:
        if self._saved is None:
            return
        restore_rng_state(self._saved.rng, self.rng)
        if self._saved.extra is not None and self.state_restore_func is not None:
            self.state_restore_func(self._saved.extra)
        if self._buffer is not None:
            self._buffer.restore_trackers(self._saved.trackers)

    def _accept(self, iterators: list[RerunDataIterator[Any]]) -> None:
        """The iteration is done: its data is consumed for good (checkpoints resume after it)."""
        self.state = RerunState.NOT_RUNNING_YET
        for it in iterators:
            it.commit()

    def _exit_after_rerun(self, iterators: list[RerunDataIterator[Any]], checkpoint: bool) -> None:
        """Back to the iteration's start, then exit (saving first when ``checkpoint``)."""
        self._restore_state()
        for it in iterators:
            it.rewind()
        self._awaiting_exit = True
        if checkpoint:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT

    # --------------------------------------------------------- provided by one of the parts
    def allows_step_before_validation(self) -> bool:  # machine.py
        raise NotImplementedError

    def check_on_device(  # recording.py
        self, value: torch.Tensor, rule: DeviceRule, message: str, tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:  # fmt: skip
        raise NotImplementedError

    def discard_ahead(self, restore_rng: bool = True) -> bool:  # ahead.py
        raise NotImplementedError

    def _peer_corrupts(self, key: CallKey) -> bool:  # peer_flow.py
        raise NotImplementedError

    def _finish_event(self) -> None:  # verdicts.py
        raise NotImplementedError

    def _log0(self, message: str) -> None:  # verdicts.py
        raise NotImplementedError

    def _describe(self, message: str) -> str:  # verdicts.py
        raise NotImplementedError

    def _log_failure(self, message: str, fatal: bool, detail: str = "") -> None:  # verdicts.py
        raise NotImplementedError
