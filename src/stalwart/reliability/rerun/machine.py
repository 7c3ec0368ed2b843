"""The rerun state machine: detect unexpected results and attribute them by re-running.

Per iteration the loop does (see :meth:`RerunStateMachine.should_run_forward_backward`)::

    while sm.should_run_forward_backward(data_iterator, iteration=it):   # 1 or 2 passes
        zero grads; forward/backward calling sm.recorder.check_loss(loss) ...  # records only
    should_checkpoint, should_exit, exit_code = sm.should_checkpoint_and_exit()
    if should_exit: save a checkpoint if should_checkpoint; exit(exit_code)  # no optimizer step
    optimizer.step()

``stalwart.loop.GuardedStep`` runs this protocol for any model (with a device-gated optimizer
step and the next iteration launched before the read). Recording never syncs. The second call
of ``should_run_forward_backward`` reads every recorded value in one deliberate host sync and
agrees with the other ranks in one collective before changing state.

The machine holds the state and its transitions. It is composed of parts that own their state:
the :class:`~stalwart.reliability.rerun.checks.recorder.Recorder` (what a pass records), the
:class:`~stalwart.reliability.rerun.ahead.AheadPass` (the pass begun ahead), the
:class:`~stalwart.reliability.rerun.attribution.peer_flow.PeerReplay` and the
:class:`~stalwart.reliability.rerun.attribution.replicas.ReplicaCheck`; the verdicts are pure
functions (``verdicts``), the lines are the
:class:`~stalwart.reliability.rerun.reporter.Reporter`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.reliability.rerun.ahead import AheadPass
from stalwart.reliability.rerun.attribution.peer import ReplayDeterminism
from stalwart.reliability.rerun.attribution.peer_flow import PeerReplay
from stalwart.reliability.rerun.attribution.replicas import (
    ReplicaCheck,
    split_replica,
)
from stalwart.reliability.rerun.attribution.verdict_file import apply_verdict
from stalwart.reliability.rerun.checks.recorder import Recorder
from stalwart.reliability.rerun.checks.rules import SPIKY_LOSS_MESSAGE, host_predicate
from stalwart.reliability.rerun.data_iterator import RerunDataIterator, wrapped_iterators
from stalwart.reliability.rerun.determinism import DeterminismStats
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.judge import EventJudge
from stalwart.reliability.rerun.passes import Saved, StateSaver
from stalwart.reliability.rerun.remedies import Remedies, RemedyConfig
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.rng import RngStateTracker
from stalwart.reliability.rerun.tracker import TrackerFile
from stalwart.reliability.rerun.types import (
    CallKey,
    CheckConfig,
    Diagnosis,
    RerunMode,
    RerunState,
    RerunVerdict,
    SpikeRewind,
    device_identity,
)
from stalwart.reliability.rerun.verdicts import (
    Items,
    TransientAction,
    event_from_json,
    event_to_json,
    exit_verdict,
    first_rejection,
    spike_rewinds,
    transient_action,
)

logger = logging.getLogger(__name__)

Agreement = Callable[[list[bool]], list[bool]]
"""Element-wise OR of per-rank flags across ranks (one collective)."""

VALIDATE = RerunMode.VALIDATE_RESULTS
STATE_DICT_VERSION = 1
_RERUNS = (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT)


class RerunStateMachine:
    """Instance-scoped rerun state machine (no singleton); see the module docstring for the loop.

    Args:
        mode: a :class:`RerunMode` or its string (``report_stats`` is an alias).
        error_injector: a :class:`RerunErrorInjector`; None means no injection.
        result_rejected_tracker_filename: file to append one line per validation event to.
        state_save_func: returns extra state to snapshot before each iteration (e.g. grad scaler).
        state_restore_func: restores what ``state_save_func`` returned before a rerun.
        process_group: group whose ranks must agree (default: world).
        rng_tracker: extra named generators to snapshot with python/numpy/torch/CUDA ones.
        checks: what the recorder's ``check_loss`` and ``check_grad_norm`` (and their batched
            forms) record.
        agreement: the cross-rank OR of the verdict flags (default: one all-reduce over
            ``process_group``); a loop may pass one that carries its exit inputs along.
        device: where :attr:`buffer` lives, once a device check needs it (default: the device
            of the first device check). No check, no buffer: nothing is computed or read.
        peer_replay: attribute a rejection that reproduces in place by replaying it on a peer
            replica in the same launch (``stalwart.reliability.rerun.attribution.peer``; needs
            more than one rank in ``process_group``, every one a data-parallel replica); off:
            Megatron's exit 16 and rerun after the relaunch.
        replay_determinism: the settings of the peer replay's pass (:class:`ReplayDeterminism`).
        replicas: the replica check (``stalwart.reliability.rerun.attribution.replicas``):
            fingerprints compared inside the step (the step calls :meth:`record_replicas`) and,
            by the loop, on the weights at its interval and before every save.
        remedies: what a transient verdict does (``exit``, Megatron's, or ``continue`` with
            the rerun's result, a device over its budget being a suspect) and whether a
            reproduced spiky loss (the data's) ends the iteration untrained with a
            :class:`SpikeRewind` verdict the loop acts on (``stalwart.loop.Shell`` restores its
            newest snapshot and skips the window); default: Megatron's behaviour
            (``stalwart.reliability.rerun.remedies``).
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
        replicas: ReplicaCheck | None = None,
        remedies: RemedyConfig | None = None,
    ) -> None:
        self.mode = RerunMode.parse(mode)
        self.injector = error_injector or RerunErrorInjector()
        tracker_name = result_rejected_tracker_filename
        tracker = TrackerFile(tracker_name) if tracker_name else None
        self.process_group = process_group
        self.rng = rng_tracker or RngStateTracker()
        any_rank = functools.partial(collectives.all_reduce_any, group=process_group)
        self._agree: Agreement = agreement or any_rank
        self.device = torch.device(device) if device is not None else None
        self.replicas = replicas
        # The state of the iteration and its passes.
        self.local_grad_checks = True  # False: gradient checks see reduced shards (FSDP2)
        self.state = RerunState.NOT_RUNNING_YET
        self.iteration = -1
        self.last_attribution_seconds: float | None = None
        self._saved: Saved | None = None
        self._awaiting_exit = False
        self._announced = False
        self._iteration_set = False
        self._pending_diagnosis: Diagnosis | None = None
        self._final_pass = False  # the clean pass after a correct result reproduced on a peer
        self._rejected_at: float | None = None
        # The parts, each owning its state.
        self.reporter = Reporter(process_group, tracker)
        self.remedies = Remedies(remedies or RemedyConfig(), self.reporter)
        self.judge = EventJudge(self.injector, self.reporter)
        self.recorder = Recorder(self.injector, self._inject_decision, self._may_record, checks)
        trackers = (self.recorder.save_trackers, self.recorder.restore_trackers)
        self._saver = StateSaver(self.rng, state_save_func, state_restore_func, *trackers)
        self._look_ahead = AheadPass(self.recorder, self._saver)
        self.peer = PeerReplay(
            peer_replay, replay_determinism or ReplayDeterminism(), self.reporter, self.rng
        )
        self.determinism = DeterminismStats(self.reporter, self.REPORTING_INTERVAL_ITERATIONS)
        logger.info("RerunStateMachine initialized in mode %s", self.mode.value)

    # ------------------------------------------------------------------------- configuration
    def get_mode(self) -> RerunMode:
        return self.mode

    def set_mode(self, mode: RerunMode | str) -> None:
        """Change the mode between iterations (Megatron's API; logs a warning, as Megatron does).

        Megatron's evaluation switches to ``disabled`` and back with ``get_mode``/``set_mode``;
        :meth:`disabled` does the same as a context manager and also keeps evaluation's checks
        out of training's device buffer. Raises ``RuntimeError`` while an iteration's passes run
        (or one begun ahead is pending, or the machine awaits its exit): a mode changed mid-way
        would judge a pass by rules it was not recorded under.
        """
        parsed = RerunMode.parse(mode)
        busy = self.state is not RerunState.NOT_RUNNING_YET
        if busy or self._look_ahead.pending or self._awaiting_exit:
            raise RuntimeError(
                f"set_mode({parsed.value!r}) between iterations only; the machine is in state "
                f"{self.state.name}"
            )
        self.mode = parsed
        logger.warning("RerunStateMachine mode set to %s", parsed.value)

    def set_iteration(self, iteration: int) -> None:
        """The 0-based index of the iteration about to run (messages and tracker lines print it
        + 1, the number the training log shows).

        The next ``should_run_forward_backward`` call that starts an iteration uses it as is
        instead of incrementing the counter (a loop may call this, then omit ``iteration=``).
        """
        self.iteration = int(iteration)
        self._iteration_set = True

    # ------------------------------------------------------------- recording (the recorder)
    def validate_result(
        self,
        result: torch.Tensor | float,
        rejection_func: Callable[..., Any] | None,
        message: str,
        comparison_func: Callable[..., Any] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Megatron's validation call: record a check of a scalar ``result``, evaluated on the
        host at the next read (:meth:`Recorder.validate_result` has the contract)."""
        self.recorder.validate_result(
            result, rejection_func, message, comparison_func, tolerance, fatal
        )

    @host_predicate
    def is_unexpectedly_large(
        self,
        result: torch.Tensor | float,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """Whether ``result`` is unexpectedly large in ``context``, a rejection function
        (:meth:`Recorder.is_unexpectedly_large`)."""
        return self.recorder.is_unexpectedly_large(
            result, threshold, context, num_samples, resample
        )

    def record_replicas(
        self,
        iteration: int,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str] | None = None,
    ) -> None:
        """After a pass and before its optimizer step: the replica fingerprints' check, with
        the skip gate (:meth:`ReplicaCheck.record`), in the passes that check them."""
        check = self.replicas
        if check is None or self.mode is not VALIDATE or self._final_pass:
            return
        if self.state in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE):
            check.record(iteration, params, names, self.recorder)

    def _may_record(self) -> bool:
        return self.mode is RerunMode.DISABLED or self.state is not RerunState.NOT_RUNNING_YET

    def _inject_decision(self, key: CallKey) -> bool:
        if self.state is RerunState.REPLAYING_ON_PEER:
            return self.mode is VALIDATE and self.peer.corrupts(key)
        if self.mode is not VALIDATE or not self.injector.enabled:
            return False
        if self.state is RerunState.INITIAL_RUN:
            return self.injector.maybe_inject(
                key, self.iteration, self.reporter.rank, device_identity()
            )
        if self.state in _RERUNS:
            return self.injector.should_corrupt(key, self.state, device_identity())
        return False

    # ------------------------------------------------------------- the pass begun ahead
    def can_gate_step(self) -> bool:
        """Whether the optimizer step may be enqueued before this pass is read, gated on the
        device: an initial pass (not determinism stats) whose every check has a device verdict
        (the gate then rejects exactly when the read will)."""
        return self.allows_step_before_validation() and self.recorder.device_evaluable

    def can_begin_ahead(self) -> bool:
        """Whether the next iteration may begin before this pass is read: a gateable pass, none
        begun ahead yet, no error injection (it decides per pass as a pass begins)."""
        return self.can_gate_step() and not self._look_ahead.pending and not self.injector.enabled

    def begin_ahead(self, iteration: int) -> None:
        """Begin ``iteration``'s initial pass now, before this pass is read (look-ahead launch).

        Saves the state to restore for it (captured now, before any of its work), freezes this
        pass's buffer values for the coming read (stream-ordered copy) and clears the buffers for
        the next pass; records go to that pass from now on. The read then evaluates this pass;
        a rejection drops the pass begun ahead, an acceptance lets the next iteration adopt it.
        """
        if not self.can_begin_ahead():
            raise RuntimeError("begin_ahead() needs an initial pass with device verdicts only")
        self._look_ahead.begin(iteration)

    def discard_ahead(self, restore_rng: bool = True) -> bool:
        """Drop the pass begun ahead (its work ran on stale state or must rerun): its records and
        large-value updates are undone, and, with ``restore_rng``, every RNG is put back to what
        it was when it began. Returns whether there was one."""
        return self._look_ahead.discard(restore_rng)

    # ------------------------------------------------------------------------ the loop's API
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Disable reruns (e.g. for evaluation). Checks recorded inside are resolved at exit with
        ``disabled`` semantics: one sync, fatal rejections raise ``RuntimeError``, others warn.
        Device checks are evaluated on the host here (the device buffer belongs to training)."""
        mode, self.mode = self.mode, RerunMode.DISABLED
        try:
            with self.recorder.host_only():
                yield
                self.resolve()
        finally:
            self.mode = mode

    def skip_iteration(self, iteration: int) -> None:
        """The loop skips ``iteration`` (``--iterations-to-skip``) without running it.

        A rerun from checkpoint still pending for that iteration (restored from the checkpoint of
        an exit 16) is dropped with a warning; otherwise it would replay a later iteration's data
        and compare it with this one's result.
        """
        self.discard_ahead()
        self.set_iteration(iteration)
        self.remedies.pending_rewind = None
        if self.state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.reporter.log0(
                f"Iteration {iteration + 1} is skipped (the skip list): "
                "dropping its pending rerun from checkpoint"
            )
            self.judge.finish()
            self.state = RerunState.NOT_RUNNING_YET

    def resolve(self) -> None:
        """Evaluate checks recorded while disabled (one sync); fatal rejections raise
        RuntimeError."""
        if self.mode is not RerunMode.DISABLED:
            raise RuntimeError("resolve() is for disabled mode; enabled modes resolve in the loop")
        self.judge.without_rerun(self.recorder.read_host_only(), self.iteration)

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
        iterators = wrapped_iterators(data_iterator, required=self.mode is not RerunMode.DISABLED)
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

    def verdict(self) -> RerunVerdict:
        """The iteration's outcome once its passes are done (logs the exit message once).

        An exit that ends an attribution carries its :class:`Diagnosis` (``rerun_verdict.json``;
        ``stalwart.reliability.exit.leave`` writes it)."""
        if self.mode is not VALIDATE:
            return RerunVerdict()
        if self.remedies.pending_rewind is not None:
            return RerunVerdict(rewind=self.remedies.pending_rewind)
        replica = self.replicas.detail if self.replicas is not None else ""
        verdict, line = exit_verdict(self.state, self._pending_diagnosis, replica)
        if line is not None:
            self.reporter.log0(line)
        return verdict

    def replay_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a loop wraps each pass in: :class:`ReplayDeterminism` during a peer replay,
        nothing otherwise (``GuardedStep`` does it)."""
        if self.state is RerunState.REPLAYING_ON_PEER:
            return self.peer.determinism.applied()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------ the transitions
    def _start_iteration(
        self, iterators: list[RerunDataIterator[Any]], iteration: int | None
    ) -> bool:
        if iteration is not None:
            self.iteration = int(iteration)
        elif not self._iteration_set:
            self.iteration += 1
        self._iteration_set = False
        self._rejected_at = None
        self.remedies.pending_rewind = None
        for it in iterators:
            it.advance()
        if self.mode is VALIDATE and not self._announced:
            # INFO: printed by every validating run, so not a warning (the text is Megatron's)
            logger.info("Result validation enabled")
            self._announced = True
        ahead = self._look_ahead.take(self.iteration)
        if ahead is not None:
            # Adopt the pass begun ahead: its state was saved before any of its work.
            self._saved, records = ahead
            self.state = RerunState.INITIAL_RUN
            self.recorder.adopt(records, gate_non_fatal=self.mode is VALIDATE)
            return True
        self._look_ahead.discard(restore_rng=False)
        if self.mode is not RerunMode.DISABLED:
            self._saved = self._saver.capture()
        self._enter(RerunState.INITIAL_RUN)
        return True

    def _after_initial_run(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self.recorder.read()
        if self.mode is RerunMode.DISABLED:
            self._accept(iterators)
            self.judge.without_rerun(items, self.iteration)
            return False
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self.judge.without_rerun(items, self.iteration)
            self.determinism.keep_initial(items)
            self._begin_rerun(iterators)
            return True
        replica, items = split_replica(items)
        rejected = self.judge.open(items, self.iteration)
        (any_rejected,) = self._agree([rejected or replica])
        if not any_rejected:
            self._accept(iterators)
            return False
        if replica and self.replicas is not None:
            self.replicas.keep_originals()
        self._rejected_at = time.monotonic()
        self.reporter.log0(
            f"Need to rerun iteration {self.iteration + 1} to check the result is reproducible"
        )
        self._begin_rerun(iterators)
        return True

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self.recorder.read()
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self.determinism.record(items, self.iteration)
            self._accept(iterators)
            return False
        if self._final_pass:  # the clean pass after a correct result reproduced on a peer
            self._final_pass = False
            self._accept(iterators)
            return False
        _, items = split_replica(items)
        attributing = self.replicas is not None and self.replicas.originals is not None
        if attributing and self._replica_exit(iterators):
            return False
        local = self.judge.first_rerun(items, self.iteration)
        ev = self.judge.event
        reproduced = ev is not None and ev.suspicious is not None
        spike = reproduced and ev is not None and ev.message == SPIKY_LOSS_MESSAGE
        seen = self.remedies.observe(
            ev is not None and not reproduced, _clean(items), self.iteration
        )
        flags = self._agree([*local, reproduced, spike, *seen])
        ckpt, fatal, _cont, anyone, spiked, transient, dirty, over = flags
        continues = self.remedies.continues
        action = transient_action(continues, transient, dirty, over, ckpt or anyone)
        if action is not TransientAction.MEGATRON:
            return self._after_transient(iterators, action, over=seen[2])
        # Fatal beats non-fatal on every rank: a "continue" never overrides a fatal request.
        # A reproduced rejection is attributed on a peer replica when there is one.
        peer = anyone and not fatal and self.peer.possible
        if peer and self._begin_peer_replay(iterators, reproduced):
            return True
        if ckpt or fatal:
            self._exit_after_rerun(iterators, checkpoint=ckpt)
            return False
        if spike_rewinds(spiked, fatal, self.remedies.may_rewind()):
            value = ev.initial_result if spike and ev is not None else None
            return self._rewind_after_spike(iterators, "in_place", value)
        return self._continue_after_failure(iterators)

    def _after_transient(
        self, iterators: list[RerunDataIterator[Any]], action: TransientAction, over: bool
    ) -> bool:
        """``--rerun-transient-policy continue``: apply the clean rerun's result, or exit 17
        naming the devices over their transient budget (the iteration's start is saved)."""
        if action is TransientAction.CONTINUE:
            self.reporter.log0(
                f"Continuing with the rerun's result of iteration {self.iteration + 1}: it is "
                "the fault-free one (a transient error; transient policy continue)"
            )
            self.judge.finish()
            self._accept(iterators)
            return False
        ev = self.judge.event
        if over and ev is not None:  # a relaunch without rerun_verdict.json still names it
            ev.suspicious = device_identity()
        message = ev.message if ev is not None else ""
        self._pending_diagnosis = self.remedies.diagnosis(over, self.iteration, message)
        self._exit_after_rerun(iterators, checkpoint=True)
        return False

    def _rewind_after_spike(
        self, iterators: list[RerunDataIterator[Any]], attribution: str, value: float | None
    ) -> bool:
        """End the iteration untrained with a :class:`SpikeRewind` verdict: its start restored,
        its micro-batches put back to be read again (the loop restores a snapshot, or skips
        them in place when it has none). ``value``: this rank's spiking loss, if any (the
        verdict carries the highest: one all-reduce, on this rare path)."""
        self._saver.restore(self._saved)
        for it in iterators:
            it.unread()
        # Deliberate sync: the spike's value for the rewind's line and tracker (a rare path).
        (highest,) = collectives.all_reduce_floats(
            [value if value is not None else -math.inf], dist.ReduceOp.MAX, self.process_group
        )
        self.remedies.pending_rewind = SpikeRewind(
            self.iteration, highest, SPIKY_LOSS_MESSAGE, attribution
        )
        how = attribution.replace("_", " ")
        self.reporter.log0(
            f"Spiky loss at iteration {self.iteration + 1} reproduced ({how}): an application "
            "error; rewinding instead of training on it"
        )
        self.judge.finish()
        self.state = RerunState.NOT_RUNNING_YET
        return False

    def _start_rerun_from_checkpoint(self, iteration: int | None) -> bool:
        if iteration is not None and iteration != self.iteration:
            logger.warning(
                "Resumed at iteration %d but the rerun state is for iteration %d; using %d",
                iteration,
                self.iteration,
                iteration,
            )
            self.iteration = int(iteration)
        self._enter(RerunState.RERUNNING_FROM_CHECKPOINT)
        return True

    def _after_rerun_from_checkpoint(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self.recorder.read()
        again, fatal, _ = self._agree(list(self.judge.second_rerun(items, self.iteration)))
        if again:
            self.reporter.log0(
                "Need to restart the job from the same checkpoint on a different GPU"
            )
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            self._awaiting_exit = True
            return False
        if fatal:
            self._pending_diagnosis = self.judge.checkpoint_diagnosis(self.iteration)
            self._awaiting_exit = True
            return False
        return self._continue_after_failure(iterators)

    def _continue_after_failure(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        self.reporter.log0(
            "Continuing normal execution because the failed validation was not fatal"
        )
        self.judge.finish()
        self._accept(iterators)
        return False

    def _begin_peer_replay(self, iterators: list[RerunDataIterator[Any]], reproduced: bool) -> bool:
        """Pick the peers and ship the inputs (one collective); True: the replay pass runs."""
        request = None
        if reproduced:
            assert self.judge.event is not None  # only a rank whose rejection reproduced asks
            saved_rng = self._saved.rng if self._saved is not None else None
            request = self.peer.request(
                self.judge.event, self.injector, iterators, saved_rng, self.local_grad_checks
            )
        identities = self.peer.plan_replay(request)
        if identities is None:
            return False
        self._rewind(iterators)
        self.peer.start(iterators, identities, self.iteration)
        self._enter(RerunState.REPLAYING_ON_PEER)
        return True

    def _after_peer_replay(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        """Compare, agree on the verdict (one collective), act: exit, or one clean pass."""
        outcome = self.peer.finish(self.recorder.read(), self.iteration)
        self._rewind(iterators)
        if self._rejected_at is not None:
            self.last_attribution_seconds = time.monotonic() - self._rejected_at
        seconds = self.last_attribution_seconds
        self.judge.diagnosis = self.peer.record_outcome(outcome, self.iteration, seconds)
        if outcome.persistent or outcome.fatal:
            self._pending_diagnosis = self.peer.diagnosis(outcome, self.iteration)
            # The checkpoint resumes this iteration, as the exit 16 one would (the relaunch
            # applies rerun_verdict.json to it: refuse the suspects, or train on).
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self._awaiting_exit = True
            return False
        spikes = [
            r.initial for r in outcome.plan.requests.values() if r.message == SPIKY_LOSS_MESSAGE
        ]
        if spike_rewinds(bool(spikes), outcome.fatal, self.remedies.may_rewind()):
            return self._rewind_after_spike(iterators, "peer_replay", max(spikes))
        self.reporter.log0(
            "Continuing normal execution because the failed validation was not fatal (a correct "
            "result, reproduced on a peer); the iteration runs once more for its gradients"
        )
        self.judge.finish()
        self._final_pass = True  # the next read accepts: the gradients of a clean pass
        self._enter(RerunState.RERUNNING_IN_PLACE)
        return True

    def _replica_exit(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        """Attribute a replica fingerprint mismatch after its rerun; True: the job exits."""
        check = self.replicas
        assert check is not None
        attribution, identities = check.attribute(self.reporter, self.iteration)
        if attribution.kind == "transient":
            check.detail = ""
            return False  # the rerun's gradients agree: train on with them
        if attribution.kind == "persistent":
            self._pending_diagnosis = check.diagnosis(
                attribution, identities, self.iteration, self.reporter
            )
        save = attribution.kind == "persistent" and attribution.weights_consistent
        self._exit_after_rerun(iterators, checkpoint=save)
        return True

    # ---------------------------------------------------------------------- a pass's life
    def _enter(self, state: RerunState) -> None:
        """Start a pass: new state, empty records, buffers cleared with their injection masks."""
        self.state = state
        self.recorder.new_pass(gate_non_fatal=self.mode is VALIDATE)

    def _rewind(self, iterators: list[RerunDataIterator[Any]]) -> None:
        """Back to the iteration's start: its state restored, its data served again."""
        self._saver.restore(self._saved)
        for it in iterators:
            it.rewind()

    def _begin_rerun(self, iterators: list[RerunDataIterator[Any]]) -> None:
        self.discard_ahead(restore_rng=False)  # the rerun restores this iteration's own state
        self._rewind(iterators)
        self._enter(RerunState.RERUNNING_IN_PLACE)

    def _accept(self, iterators: list[RerunDataIterator[Any]]) -> None:
        """The iteration is done: its data is consumed for good (checkpoints resume after it)."""
        self.state = RerunState.NOT_RUNNING_YET
        for it in iterators:
            it.commit()

    def _exit_after_rerun(self, iterators: list[RerunDataIterator[Any]], checkpoint: bool) -> None:
        """Back to the iteration's start, then exit (saving first when ``checkpoint``)."""
        self._rewind(iterators)
        self._awaiting_exit = True
        if checkpoint:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT

    def forget_rerun_from_checkpoint(self) -> None:
        """Drop a loaded "rerun this iteration from the checkpoint" mark: a rerun verdict has
        settled it (`stalwart.reliability.rerun.attribution.verdict_file`); training goes on
        normally."""
        self.judge.finish()
        self.state = RerunState.NOT_RUNNING_YET
        self._awaiting_exit = False
        self._pending_diagnosis = None
        if self.replicas is not None:
            self.replicas.detail = ""

    # --------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state, identical on every rank (collective: call it on all ranks).

        JSON-friendly (strings, numbers, lists, dicts). Always the same structure (steady state
        included). ``ranks[r]`` holds rank r's failed call, initial result, suspicious identity,
        identity at save time, injector state and large-value windows (host and device);
        gathered with one ``all_gather_object``. The data position is not included: the data
        iterator's own state gives the start of ``iteration``.
        """
        host, device = self.recorder.large_state()
        mine = {
            "event": event_to_json(self.judge.event),
            "identity": list(device_identity()),
            "injector": self.injector.state_dict(),
            "large_values": host,
            "device_large_values": device,
            "transients": self.remedies.state_dict(),
        }
        return {
            "version": STATE_DICT_VERSION,
            "mode": self.mode.value,
            "state": self.state.name,
            "iteration": self.iteration,
            "world_size": self.reporter.world_size,
            "ranks": collectives.all_gather_objects(mine, self.process_group),
        }

    def load_state_dict(self, sd: dict[str, Any] | None, world_size: int | None = None) -> None:
        """Restore after a restart. Ignored (with a warning) when the world size changed, when this
        machine is disabled, or when the checkpoint was taken in steady state (only the
        large-value windows are restored then). The mode given now always wins."""
        if not sd:
            return
        expected = self.reporter.world_size if world_size is None else world_size
        if sd.get("world_size") != expected:
            logger.warning(
                "World size changed (%s -> %s): rerun state ignored", sd.get("world_size"), expected
            )
            return
        if self.mode is RerunMode.DISABLED:
            logger.warning("Rerun state machine disabled; ignoring its checkpointed state")
            return
        self.remedies.load([row.get("transients") for row in sd["ranks"]])
        mine = sd["ranks"][self.reporter.group_rank]
        self.recorder.load_large_state(mine["large_values"], mine.get("device_large_values") or {})
        state = RerunState[sd["state"]]
        if state is not RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return
        if self.mode is not VALIDATE:
            logger.warning("Checkpoint awaits a rerun but mode is %s: ignored", self.mode.value)
            return
        self.judge.event = event_from_json(mine["event"])
        self.injector.load_state_dict(mine["injector"])
        self.state = state
        self.iteration = int(sd["iteration"])
        self._awaiting_exit = False

    def after_load(self, checkpoint_path: str) -> None:
        """After its checkpoint was loaded (``Checkpointer.load`` calls it; collective): apply
        the save directory's ``rerun_verdict.json`` (refuse a suspect device with
        ``SuspectDeviceError``, or drop a settled rerun mark and train on)."""
        apply_verdict(self, checkpoint_path)


def _clean(items: Items) -> bool:
    """A pass rejected none of its calls."""
    return first_rejection(items) is None


__all__ = ["Agreement", "RerunStateMachine"]
