"""The rerun state machine: detect unexpected results and attribute them by re-running.

Per iteration the loop does (see :meth:`RerunStateMachine.should_run_forward_backward`)::

    while sm.should_run_forward_backward(data_iterator, iteration=it):   # 1 or 2 passes
        zero grads; forward/backward calling sm.check_loss(loss) ...       # records only
    should_checkpoint, should_exit, exit_code = sm.should_checkpoint_and_exit()
    if should_exit: save a checkpoint if should_checkpoint; exit(exit_code)  # no optimizer step
    optimizer.step()

``stalwart.loop.GuardedStep`` runs this protocol for any model (with a device-gated optimizer
step and the next iteration launched before the read). Recording never syncs. The second call
of ``should_run_forward_backward`` reads every recorded value in one deliberate host sync and
agrees with the other ranks in one collective before changing state.

The machine's parts live in their own modules, each a subclass of ``core.MachineCore`` (the
state they share, declared once): ``recording``, ``ahead``, ``verdicts``, ``peer_flow`` and
``replicas``; this module holds the constructor, the public API and the state transitions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.reliability.rerun.ahead import AheadMixin
from stalwart.reliability.rerun.buffer import (
    INF_RULE,
    NAN_RULE,
)
from stalwart.reliability.rerun.checks import CheckRows
from stalwart.reliability.rerun.core import VALIDATE
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.passes import Records
from stalwart.reliability.rerun.peer import ReplayDeterminism
from stalwart.reliability.rerun.peer_flow import PeerReplayMixin
from stalwart.reliability.rerun.reading import read_values
from stalwart.reliability.rerun.recording import RecordingMixin
from stalwart.reliability.rerun.replicas import ReplicaGate, ReplicaMixin
from stalwart.reliability.rerun.rng import RngStateTracker
from stalwart.reliability.rerun.tracker import TrackerFile
from stalwart.reliability.rerun.types import (
    CheckConfig,
    RerunMode,
    RerunState,
)
from stalwart.reliability.rerun.verdicts import EventMixin

logger = logging.getLogger(__name__)

Agreement = Callable[[list[bool]], list[bool]]
"""Element-wise OR of per-rank flags across ranks (one collective)."""


class RerunStateMachine(RecordingMixin, AheadMixin, EventMixin, PeerReplayMixin, ReplicaMixin):
    """Instance-scoped rerun state machine (no singleton); see the module docstring for the loop.

    Args:
        mode: a :class:`RerunMode` or its string (``report_stats`` is an alias).
        error_injector: a :class:`RerunErrorInjector`; None means no injection.
        result_rejected_tracker_filename: file to append one line per validation event to.
        state_save_func: returns extra state to snapshot before each iteration (e.g. grad scaler).
        state_restore_func: restores what ``state_save_func`` returned before a rerun.
        process_group: group whose ranks must agree (default: world).
        rng_tracker: extra named generators to snapshot with python/numpy/torch/CUDA ones.
        checks: what :meth:`check_loss` and :meth:`check_grad_norm` record.
        agreement: the cross-rank OR of the verdict flags (default: one all-reduce over
            ``process_group``); a loop may pass one that carries its exit inputs along.
        device: where :attr:`buffer` lives, once a device check needs it (default: the device
            of the first device check). No check, no buffer: nothing is computed or read.
        peer_replay: attribute a rejection that reproduces in place by replaying it on a peer
            replica in the same launch (``stalwart.reliability.rerun.peer``; needs more than one
            rank in ``process_group``, every one a data-parallel replica); off: Megatron's
            exit 16 and rerun after the relaunch.
        replay_determinism: the settings of the peer replay's pass (:class:`ReplayDeterminism`).
        replicas: fingerprints compared across replicas inside the step
            (``stalwart.reliability.rerun.replicas``; the step calls :meth:`record_replicas`).
    """

    REPORTING_INTERVAL_ITERATIONS = 2

    def __init__(
        self,
        mode: RerunMode | str = RerunMode.DISABLED,
        error_injector: RerunErrorInjector | None = None,
        result_rejected_tracker_filename: str | None = None,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        rng_tracker: RngStateTracker | None = None,
        checks: CheckConfig | None = None,
        agreement: Agreement | None = None,
        device: torch.device | str | None = None,
        peer_replay: bool = False,
        replay_determinism: ReplayDeterminism | None = None,
        replicas: ReplicaGate | None = None,
    ) -> None:
        self.mode = RerunMode.parse(mode)
        self.injector = error_injector or RerunErrorInjector()
        self.tracker = (
            TrackerFile(result_rejected_tracker_filename)
            if result_rejected_tracker_filename
            else None
        )
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.process_group = process_group
        self.rng = rng_tracker or RngStateTracker()
        self.checks = checks or CheckConfig()
        self._agree: Agreement = agreement or functools.partial(
            collectives.all_reduce_any, group=process_group
        )
        self.state = RerunState.NOT_RUNNING_YET
        self.iteration = -1
        self.diagnosis = None
        self.event = None
        self.stats = {}
        self.last_report = None
        self._records = Records()  # where new records go (the pass begun ahead, if any)
        self._reading = self._records  # the pass the next read evaluates
        self._ahead = None
        self._buffer = None
        self._buffers = []
        self._windows_to_load = {}
        self.device = torch.device(device) if device is not None else None
        self._saved = None
        self._saved_results = {}
        self._large = {}
        self._awaiting_exit = False
        self._announced = False
        self._iteration_set = False
        self._host_checks = False
        self._check_rows = CheckRows()
        self._init_attribution(peer_replay, replay_determinism, replicas)
        logger.info("RerunStateMachine initialized in mode %s", self.mode.value)

    def _init_attribution(
        self,
        peer_replay: bool,
        replay_determinism: ReplayDeterminism | None,
        replicas: ReplicaGate | None,
    ) -> None:
        """The state of the peer replay and the replica fingerprints (stalwart's attribution)."""
        self.peer_replay = peer_replay
        self.replay_determinism = replay_determinism or ReplayDeterminism()
        self.local_grad_checks = True  # False: gradient checks see reduced shards (FSDP2)
        self.replicas = replicas
        self.last_attribution_seconds = None
        self._peer_plan = None
        self._pending_diagnosis = None
        self._final_pass = False
        self._rejected_at = None
        self._replica_originals = None
        self._replica_detail = ""

    # ------------------------------------------------------------------------- configuration
    def get_mode(self) -> RerunMode:
        return self.mode

    def set_mode(self, mode: RerunMode | str) -> None:
        """Change the mode between iterations (the loop state is kept)."""
        self.mode = RerunMode.parse(mode)
        logger.warning("RerunStateMachine mode set to %s", self.mode.value)

    def set_iteration(self, iteration: int) -> None:
        """The 0-based index of the iteration about to run (messages and tracker lines print it
        + 1, the number the training log shows).

        The next ``should_run_forward_backward`` call that starts an iteration uses it as is
        instead of incrementing the counter (a loop may call this, then omit ``iteration=``).
        """
        self.iteration = int(iteration)
        self._iteration_set = True

    def register_generator(
        self, name: str, get: Callable[[], Any], set: Callable[[Any], object]
    ) -> None:
        """Snapshot/restore an extra RNG with every iteration (e.g. a tensor-parallel tracker)."""
        self.rng.register_generator(name, get, set)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Disable reruns (e.g. for evaluation). Checks recorded inside are resolved at exit with
        ``disabled`` semantics: one sync, fatal rejections raise ``RuntimeError``, others warn.
        Device checks are evaluated on the host here (the device buffer belongs to training)."""
        saved = (self.mode, self._records, self._reading, self._host_checks)
        self.mode, self._host_checks = RerunMode.DISABLED, True
        self._records = self._reading = Records()
        try:
            yield
            self.resolve()
        finally:
            self.mode, self._records, self._reading, self._host_checks = saved

    def skip_iteration(self, iteration: int) -> None:
        """The loop skips ``iteration`` (``--iterations-to-skip``) without running it.

        A rerun from checkpoint still pending for that iteration (restored from the checkpoint of
        an exit 16) is dropped with a warning; otherwise it would replay a later iteration's data
        and compare it with this one's result.
        """
        self.discard_ahead()
        self.set_iteration(iteration)
        if self.state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._log0(
                f"Iteration {iteration + 1} is skipped (--iterations-to-skip): "
                "dropping its pending rerun from checkpoint"
            )
            self._finish_event()
            self.state = RerunState.NOT_RUNNING_YET

    def resolve(self) -> None:
        """Evaluate checks recorded while disabled (one sync); fatal rejections raise RuntimeError."""
        if self.mode is not RerunMode.DISABLED:
            raise RuntimeError("resolve() is for disabled mode; enabled modes resolve in the loop")
        items = read_values(self._reading.pending, [])
        self._records = self._reading = Records()
        self._apply_without_rerun(items)

    # ------------------------------------------------------------------------ state machine
    def should_run_forward_backward(
        self,
        data_iterator: RerunDataIterator[Any] | list[RerunDataIterator[Any] | None] | None = None,
        iteration: int | None = None,
    ) -> bool:
        """Drive the loop: True means run (or re-run) forward/backward for this iteration.

        ``iteration`` (0-based) is taken on the first call of each iteration; without it the
        counter is incremented. After a pass, this call performs the iteration's one deliberate
        host sync and one agreement collective (validate_results mode).
        """
        iterators = self._sanitize(data_iterator)
        if self._awaiting_exit:
            raise RuntimeError(
                "the rerun state machine asked the job to exit; call should_checkpoint_and_exit()"
            )
        state = self.state
        if state is RerunState.NOT_RUNNING_YET:
            return self._start_iteration(iterators, iteration)
        if state is RerunState.INITIAL_RUN:
            return self._after_initial_run(iterators)
        if state is RerunState.RERUNNING_IN_PLACE:
            return self._after_rerun_in_place(iterators)
        if state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return self._start_rerun_from_checkpoint(iteration)
        if state is RerunState.RERUNNING_FROM_CHECKPOINT:
            return self._after_rerun_from_checkpoint(iterators)
        if state is RerunState.REPLAYING_ON_PEER:
            return self._after_peer_replay(iterators)
        raise RuntimeError(f"should_run_forward_backward called in state {state.name}")

    def allows_step_before_validation(self) -> bool:
        """True in an iteration's initial pass unless every pass is rerun (determinism stats).

        A device-gated optimizer step may then be enqueued before this pass is read: the pass is
        either accepted (the step stands) or rerun, and a rerun decides afresh.
        """
        return (
            self.state is RerunState.INITIAL_RUN
            and self.mode is not RerunMode.REPORT_DETERMINISM_STATS
        )

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """``(should_checkpoint, should_exit, exit_code)``; on exit the optimizer must not step."""
        verdict = self.verdict()
        return verdict.checkpoint, verdict.exit, verdict.exit_code

    def _start_iteration(
        self, iterators: list[RerunDataIterator[Any]], iteration: int | None
    ) -> bool:
        if iteration is not None:
            self.iteration = int(iteration)
        elif not self._iteration_set:
            self.iteration += 1
        self._iteration_set = False
        self._rejected_at = None
        for it in iterators:
            it.advance()
        if self.mode is VALIDATE and not self._announced:
            # INFO: printed by every validating run, so not a warning (the text is Megatron's)
            logger.info("Result validation enabled")
            self._announced = True
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.iteration == self.iteration:
            # Adopt the pass begun ahead: its state was saved before any of its work.
            self._saved = ahead.saved
            self.state = RerunState.INITIAL_RUN
            self._records = self._reading = ahead.records
            self._begin_buffers(adopt_ahead=True)
            return True
        if ahead is not None:
            self._ahead = ahead
            self.discard_ahead(restore_rng=False)
        if self.mode is not RerunMode.DISABLED:
            self._saved = self._capture_saved()
        self._enter(RerunState.INITIAL_RUN)
        return True

    def _after_initial_run(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self._read()
        if self.mode is RerunMode.DISABLED:
            self._accept(iterators)
            self._apply_without_rerun(items)
            return False
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._apply_without_rerun(items)
            self._saved_results = {rec.key: v for rec, v in items}
            self._begin_rerun(iterators)
            return True
        replica, items = self._split_replica(items)
        rejected = self._first_rejection(items)
        (any_rejected,) = self._agree([rejected or replica])
        if not any_rejected:
            self._accept(iterators)
            return False
        if replica and self.replicas is not None:
            self._replica_originals = self.replicas.host_rows()
        self._rejected_at = time.monotonic()
        self._log0(
            f"Need to rerun iteration {self.iteration + 1} to check the result is reproducible"
        )
        self._begin_rerun(iterators)
        return True

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self._read()
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._record_stats(items)
            self._accept(iterators)
            return False
        if self._final_pass:  # the clean pass after a correct result reproduced on a peer
            self._final_pass = False
            self._accept(iterators)
            return False
        _, items = self._split_replica(items)
        if self._replica_originals is not None and self._replica_exit(iterators):
            return False
        local = self._first_rerun_verdict(items)
        reproduced = self.event is not None and self.event.suspicious is not None
        ckpt, fatal, _cont, anyone = self._agree([*local, reproduced])
        # Fatal beats non-fatal on every rank: a "continue" never overrides a fatal request.
        # A reproduced rejection is attributed on a peer replica when there is one.
        peer = anyone and not fatal and self._peer_replay_possible()
        if peer and self._begin_peer_replay(iterators, reproduced):
            return True
        if ckpt or fatal:
            self._exit_after_rerun(iterators, checkpoint=ckpt)
            return False
        self._log0("Continuing normal execution because the failed validation was not fatal")
        self._finish_event()
        self._accept(iterators)
        return False

    def _start_rerun_from_checkpoint(self, iteration: int | None) -> bool:
        if iteration is not None and iteration != self.iteration:
            logger.warning(
                "Resumed at iteration %d but the rerun state is for iteration %d; using %d",
                iteration, self.iteration, iteration,
            )  # fmt: skip
            self.iteration = int(iteration)
        self._enter(RerunState.RERUNNING_FROM_CHECKPOINT)
        return True

    def _after_rerun_from_checkpoint(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self._read()
        again, fatal, _ = self._agree(list(self._second_rerun_verdict(items)))
        if again:
            self._log0("Need to restart the job from the same checkpoint on a different GPU")
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            self._awaiting_exit = True
            return False
        if fatal:
            self._pending_diagnosis = self._checkpoint_diagnosis()
            self._awaiting_exit = True
            return False
        self._log0("Continuing normal execution because the failed validation was not fatal")
        self._finish_event()
        self._accept(iterators)
        return False

    # ------------------------------------------------------------------------------ helpers
    def _sanitize(self, data_iterator: Any) -> list[RerunDataIterator[Any]]:
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
            elif it is not None and self.mode is not RerunMode.DISABLED:
                raise TypeError("data iterator is not wrapped with RerunDataIterator")
        return out


__all__ = ["INF_RULE", "NAN_RULE", "Agreement", "RerunStateMachine"]
