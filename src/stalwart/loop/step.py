"""The guarded step: one training iteration under the rerun state machine, for any loop.

Usage (a hand-written loop without the shell; ``stalwart.loop.Shell`` builds the step and
hands each iteration over, its skip list and look-ahead included: ``step.run(it)``)::

    machine = RerunConfig().build(device)
    data = RerunDataIterator(batches)                  # micro-batches, any objects
    step = GuardedStep(model=model, optimizer=opt, forward_step=fwd, machine=machine,
                       data=data, num_microbatches=4, clip_grad=1.0)
    for number in range(start + 1, iters + 1):         # counted from 1, as logged
        result = step.run(number, launch_next=number < iters)
        if result.verdict.exit:                        # 16 (save first) or 17
            ...

``fwd(batch, model)`` returns the loss, or a dict with ``"loss"`` and values to report. Per
iteration :meth:`GuardedStep.run` does: the rerun machine's passes (one, or two with a replay on
the same micro-batches and RNG), each forward-backward by the plan with the loss and gradient
checks on the device; the optimizer step gated on the device and enqueued before the machine's
one host read when the optimizer allows it (else after the read, host-decided); the next
iteration's first work launched before that read (``stalwart.loop.lookahead``); and the verdict.
A rejected iteration never touches the parameters or the optimizer state.

Between ``run`` calls the next iteration may be in flight: call :meth:`settle` before anything
that draws random numbers, reads the data iterator or changes parameters (``evaluate``,
``skip`` and ``state_dict`` settle themselves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stalwart.loop.compute_weights import (
    NO_COMPUTE_WEIGHTS,
    ComputeWeights,
    check_compute_weights,
)
from stalwart.loop.data_parallel_grads import ReducedGradChecks
from stalwart.loop.evaluation import evaluate
from stalwart.loop.iterations import Iteration
from stalwart.loop.lookahead import LookAhead
from stalwart.loop.microbatches import (
    NO_TIMERS,
    ForwardStep,
    MicroBatches,
    Reported,
    StepTimers,
    average_reported,
)
from stalwart.loop.observer import NULL_OBSERVER, StepHooks, in_regions, staged_in_regions
from stalwart.loop.optimizer import EagerOptimizer, Stepped
from stalwart.loop.plans import EagerPlan, GraphPlan, PlanParts
from stalwart.loop.precision import NullLossScaler
from stalwart.observability.goodput import GoodputLedger, NullGoodputLedger
from stalwart.observability.goodput.records import Bucket
from stalwart.observability.timer_names import FORWARD_BACKWARD, OPTIMIZER
from stalwart.reliability.exit import Agreed, IterationAgreement
from stalwart.reliability.rerun import (
    GradCheckState,
    RerunDataIterator,
    RerunStateMachine,
    RerunVerdict,
    register_grad_check_hook,
)
from stalwart.reliability.rerun.attribution.fingerprints import replicas_agree

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one iteration produced. Tensors stay on the device; nothing here forced a sync.

    ``verdict``: the rerun machine's (exit 16/17, a spike rewind, or go on); ``agreed``: the
    exit inputs agreed in the iteration's collective; ``skipped``: no optimizer step (a
    rejected iteration, an fp16 overflow, ``GuardedStep.skip``).
    """

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norm: torch.Tensor | None = None
    num_zeros: torch.Tensor | None = None
    skipped: bool = False
    verdict: RerunVerdict = field(default_factory=RerunVerdict)
    agreed: Agreed = field(default_factory=Agreed)


# Stateless: the ledger of a step that books no goodput.
NO_LEDGER = NullGoodputLedger()


class GuardedStep:
    """One guarded training iteration (see the module docstring).

    Args:
        model: the (possibly DDP/FSDP2-wrapped) module; ``forward_step`` receives it.
        optimizer: stepped once per accepted iteration. Fused Adam/AdamW/SGD/Adagrad are gated
            on the device (and allow the look-ahead); others step after the host read.
        forward_step: ``(batch, model) -> loss | {"loss": ..., **reported}``.
        machine: the rerun state machine (its ``checks`` say which checks run).
        data: the training micro-batches, wrapped for replay.
        num_microbatches: per iteration (``run`` may override it).
        plan: :class:`EagerPlan` (default) or :class:`GraphPlan`.
        clip_grad: global gradient-norm clip (0: none; the norm is still returned).
        loss_scaler: fp16 dynamic loss scaling (``stalwart.loop.DynamicLossScaler``).
        autocast: factory of the forward's autocast context (e.g. bf16).
        compute_weights: :class:`stalwart.loop.ComputeWeights`: bf16 copies of the matmul
            weights made once per pass, fp32 gradients accumulated per micro-batch (needs
            ``autocast`` to their dtype). With a DDP-wrapped model the micro-batches run on
            ``model.module`` and the step averages the gradients itself after the pass
            (`stalwart.loop.data_parallel_grads`); not with FSDP2.
        lookahead: launch the next iteration before the read when possible.
        dp_group: the data-parallel group (reported values, the gate's max-reduction).
        agreement: the machine's :class:`IterationAgreement`, to return the exit inputs.
        timers / observer / log_num_zeros: the run's timers (default: none timed), the
            :class:`stalwart.loop.observer.StepHooks` (a :class:`StepObserver`: stragglers,
            dumps, the memory release; default: the null one, which costs nothing), the zeros
            count. An enabled observer's ``iteration_region()`` times every forward-backward
            call (its communication); its ``graph_safe()`` part keeps its compute regions in a
            graph.
        goodput: a :class:`stalwart.observability.goodput.GoodputLedger` (default: the null
            one, nothing booked): rerun passes go to
            its ``rerun`` bucket (the loop wraps ``run`` in ``ledger.step``); the look-ahead's
            work is booked with the iteration it belongs to (``ledger.ahead``; a dropped
            launch stays where it ran).
        backward: ``backward(scaled_loss)`` instead of ``scaled_loss.backward()``: a framework's
            own (Lightning's ``manual_backward``, which prepares DDP's reducer first).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        forward_step: ForwardStep,
        machine: RerunStateMachine,
        data: RerunDataIterator[Any],
        num_microbatches: int,
        plan: EagerPlan | GraphPlan | None = None,
        clip_grad: float = 0.0,
        loss_scaler: NullLossScaler | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        compute_weights: ComputeWeights | None = None,
        lookahead: bool = True,
        dp_group: dist.ProcessGroup | None = None,
        agreement: IterationAgreement | None = None,
        timers: StepTimers = NO_TIMERS,
        observer: StepHooks = NULL_OBSERVER,
        log_num_zeros: bool = False,
        goodput: GoodputLedger | NullGoodputLedger = NO_LEDGER,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.model, self.optimizer, self.machine, self.data = model, optimizer, machine, data
        self.num_microbatches = num_microbatches
        self.loss_scaler = loss_scaler or NullLossScaler()
        self.dp_group = dp_group
        self.agreement = agreement
        self.timers, self.observer = timers, observer
        self.params, self.param_names = _trained_parameters(model)
        device = self.params[0].device if self.params else torch.device("cpu")
        recorder = machine.recorder
        buffer = recorder.check_buffer(device) if recorder.checks.any else recorder.buffer
        gate_group = dp_group if dp_group is not None else _world()
        micro_batches = self._micro_batches(
            forward_step, device, gate_group, autocast, compute_weights, backward
        )
        gate = buffer.gate if buffer is not None else None
        eager_optimizer = self._eager_optimizer(gate, micro_batches, clip_grad, log_num_zeros)
        parts = PlanParts(model, optimizer, self.params, micro_batches, eager_optimizer, clip_grad)
        self.runners = (plan or EagerPlan()).build(parts)
        self._goodput = goodput
        self.rejected = False  # whether the last run() was rejected (exit 16/17, a rewind)
        self._observe(observer, lookahead)
        self._closed = False

    def _eager_optimizer(
        self, gate: Any, micro_batches: MicroBatches, clip_grad: float, log_num_zeros: bool
    ) -> EagerOptimizer:
        """The optimizer step outside a graph, behind the check buffer's ``gate``."""
        return EagerOptimizer(
            self.optimizer,
            self.params,
            clip_grad=clip_grad,
            gate=gate,
            loss_scaler=self.loss_scaler,
            log_num_zeros=log_num_zeros,
            timers=self.timers,
            norm_source=micro_batches.grad_checks,  # the clip reuses the check's norm
        )

    def _observe(self, observer: StepHooks, lookahead: bool) -> None:
        """The observer's regions around each forward-backward call and the look-ahead's."""
        self._forward_backward = in_regions(self.runners.forward_backward, observer)
        allows = observer.allows_lookahead
        self.lookahead_enabled = lookahead and allows and self.runners.optimizer.gated
        self._lookahead = LookAhead(
            self.machine,
            self.data,
            self._forward_backward,
            self.runners.splittable,
            self.runners.lookahead_ready,
            staged_in_regions(self.runners.stage_pass, observer),
        )

    def _micro_batches(
        self,
        forward_step: ForwardStep,
        device: torch.device,
        gate_group: dist.ProcessGroup | None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None,
        compute_weights: ComputeWeights | None,
        backward: Callable[[torch.Tensor], None] | None,
    ) -> MicroBatches:
        check_compute_weights(compute_weights, self.model, autocast)
        # DDP under compute copies: the micro-batches run on the unwrapped module (DDP's hooks
        # sit on the fp32 parameters the forward no longer uses) and the pass's end reduces.
        reduced = compute_weights is not None and isinstance(self.model, DistributedDataParallel)
        runs_on = cast(nn.Module, self.model.module) if reduced else self.model
        return MicroBatches(
            runs_on,
            forward_step,
            self.machine,
            device,
            self.loss_scaler,
            autocast or contextlib.nullcontext,
            grad_checks=self._grad_checks(gate_group, reduced),
            gate_group=gate_group,
            timers=self.timers,
            observer=self.observer,
            backward=backward,
            compute_weights=compute_weights or NO_COMPUTE_WEIGHTS,
        )

    def _grad_checks(self, group: dist.ProcessGroup | None, reduced: bool) -> GradCheckState | None:
        """Per-bucket gradient checks: DDP's comm hook (before its all-reduce), else after the
        backward (single rank, FSDP2's local shards). ``reduced`` (DDP with compute copies):
        after the backward, followed by the all-reduce DDP's reducer would have done."""
        if reduced:
            assert isinstance(self.model, DistributedDataParallel)
            return ReducedGradChecks(self.machine, self.model, group)
        if not isinstance(self.model, DistributedDataParallel) and _world_size(group) > 1:
            # FSDP2: the checked gradient shards are already reduced, not this rank's own
            # values; a peer cannot replay them (the loss checks stay local).
            self.machine.local_grad_checks = False
        if not self.machine.recorder.checks.grads:
            return None
        if isinstance(self.model, DistributedDataParallel):
            register_grad_check_hook(self.model, self.machine.recorder, process_group=group)
            return None
        return GradCheckState(self.machine.recorder, self.params)

    # ------------------------------------------------------------------------ the iteration
    def run(
        self,
        iteration: int | Iteration,
        *,
        num_microbatches: int | None = None,
        launch_next: bool | None = None,
    ) -> StepResult:
        """The iteration numbered ``iteration`` (counted from 1, as logged) under the rerun
        machine; see the module docstring. Given the shell's :class:`Iteration`, a skipped one
        is skipped (:meth:`skip`) and its ``launch_next`` is the default.

        ``launch_next``: the next iteration is a plain training iteration with the same
        micro-batch count (the loop knows: not the last, not skipped, no evaluation before it;
        default: the handle's, else True).
        """
        if isinstance(iteration, Iteration):
            if iteration.skipped:
                return self.skip(iteration.number, num_microbatches)
            launch_next = iteration.launch_next if launch_next is None else launch_next
            iteration = iteration.number
        n = num_microbatches or self.num_microbatches
        # The machine counts from 0.
        return self._run(_index(iteration), n, True if launch_next is None else launch_next)

    def _run(self, iteration: int, n: int, launch_next: bool) -> StepResult:
        """:meth:`run` of the machine's ``iteration`` (0-based) on ``n`` micro-batches."""
        launched = self._lookahead.pending
        if launched is not None and (launched.iteration, launched.num_microbatches) != (
            iteration,
            n,
        ):
            self.settle()
        if self.agreement is not None:
            self.agreement.begin()
        reported: Reported = []
        losses: dict[str, torch.Tensor] | None = None
        stepped: Stepped | None = None
        passes = 0
        while self.machine.should_run_forward_backward(self.data, iteration=iteration):
            self.runners.optimizer.join()  # a rerun pass must not race an overlapped step
            if passes:
                if self._lookahead.pending is not None:
                    self._dropped_ahead()
                self._lookahead.forget()  # the machine dropped it: the pass is rerun
            with self._rerun_span(passes), self.machine.replay_context():
                reported = self._pass(n, first=passes == 0)
            # Replica fingerprints of this pass, gated like the checks (device work only).
            self.machine.record_replicas(iteration, self.params, self.param_names)
            passes += 1
            stepped, losses = None, None
            if self.runners.optimizer.gated and self.machine.can_gate_step():
                ahead = launch_next and self.lookahead_enabled and passes == 1
                # The launch may overwrite a graph's outputs: average this pass's values first
                # (and, like the launch's host work, before the short step).
                losses = average_reported(reported, self.dp_group)
                # The launch's work is the next iteration's forward-backward: its timer.
                staged = ahead and self._timed_ahead(self._lookahead.prepare, iteration + 1, n)
                stepped = self._optimizer_step(gated=True, overlap=not staged)
                if ahead:
                    self.runners.optimizer.join()  # the next pass reads the stepped weights
                    self._timed_ahead(self._lookahead.launch, iteration + 1, n)
        self.runners.optimizer.join()
        verdict = self._safe_to_save(self.machine.verdict())
        agreed = self.agreement.finish() if self.agreement is not None else Agreed()
        if losses is None and reported:
            losses = average_reported(reported, self.dp_group)
        self.rejected = verdict.rejected  # the shell books the iteration as rerun time
        if verdict.rejected:  # an exit, or a spike rewind: the step is not applied
            return StepResult(losses or {}, None, None, True, verdict, agreed)
        if stepped is None:
            stepped = self._optimizer_step(gated=False)
        return StepResult(
            losses or {}, stepped.grad_norm, stepped.num_zeros, stepped.skipped, verdict, agreed
        )

    def _safe_to_save(self, verdict: RerunVerdict) -> RerunVerdict:
        """A diagnosis that saves the pre-iteration state saves it from every replica (DCP
        writes each replicated tensor from one rank, maybe the suspect's). The step was skipped
        on every rank, so the copies are what the last accepted step left; this proves it:
        parameters and optimizer state compared bitwise across the group (one gather). On a
        mismatch nothing is saved (the relaunch resumes the last checkpoint)."""
        if not (verdict.checkpoint and verdict.diagnosis is not None):
            return verdict
        try:
            same = replicas_agree(self.model, self.optimizer, self.machine.process_group)
        except (ValueError, TypeError):  # FSDP2 shards: no replica to compare with
            return verdict
        if same:
            return verdict
        logger.error(
            "the replicas' parameters or optimizer state differ: not saving the pre-iteration "
            "state of the diagnosed iteration (resume from the last checkpoint)"
        )
        diagnosis = dataclasses.replace(verdict.diagnosis, checkpoint_iteration=None)
        return dataclasses.replace(verdict, checkpoint=False, diagnosis=diagnosis)

    def _rerun_span(self, passes: int) -> contextlib.AbstractContextManager[Any]:
        """A replay of the iteration is the goodput ledger's rerun time."""
        if passes == 0:
            return contextlib.nullcontext()
        return self._goodput.span(Bucket.RERUN)

    @property
    def capture_state(self) -> Any:
        """Changes whenever a plan's graph was captured (compile/capture time, for goodput)."""
        return self.runners.capture_state()

    def _pass(self, n: int, first: bool) -> Reported:
        timer = self.timers(FORWARD_BACKWARD)
        timer.start()
        launched = self._lookahead.take(self.data) if first else None
        fb = self._forward_backward
        if launched is None:
            reported = fb(data_iterator=self.data, num_microbatches=n)
        elif len(launched.batches) == n:
            reported = launched.reported
        else:
            rest = fb(data_iterator=self.data, num_microbatches=n, first=len(launched.batches))
            reported = launched.reported + rest
        # e.g. release cached memory after each forward-backward; outside any graph
        self.observer.after_forward_backward()
        timer.stop()
        return reported

    def _timed_ahead(self, work: Callable[[int, int], bool], iteration: int, n: int) -> bool:
        """Part of the next iteration's pass queued now (the look-ahead): timed in
        ``forward-backward``, which its own ``_pass`` then does not time again (that pass only
        takes the launched work). A log interval's sum is then every pass's work once."""
        timer = self.timers(FORWARD_BACKWARD)
        timer.start()
        try:
            with self._ahead_span():  # the goodput ledger books it with the next iteration
                return work(iteration, n)
        finally:
            timer.stop()

    def _ahead_span(self) -> contextlib.AbstractContextManager[Any]:
        return self._goodput.ahead()

    def _dropped_ahead(self) -> None:
        """A launch was dropped: the ledger keeps its time where it ran."""
        self._goodput.drop_ahead()

    def _optimizer_step(self, gated: bool, overlap: bool = True) -> Stepped:
        if getattr(self.runners.optimizer, "stepped_in_pass", False):
            # The step ran inside the full-iteration graph: an optimizer figure here would be
            # ~0 and wrong. EVENTS mode moves its device time from forward-backward to
            # optimizer at the replay's boundary event (observability.timer_split).
            return self.runners.optimizer.step(gated=gated, overlap=overlap)
        timer = self.timers(OPTIMIZER)
        timer.start()
        try:
            return self.runners.optimizer.step(gated=gated, overlap=overlap)
        finally:
            # A step overlapped on a second stream: a device timer's end event goes there.
            with self.runners.optimizer.on_step_stream():
                timer.stop()

    # ----------------------------------------------------------------------- between steps
    def settle(self) -> None:
        """Drop the next iteration's launched work (every RNG back to its start; its data is
        served again next) and order later work after the optimizer step. Idempotent."""
        if self._lookahead.discard(restore_rng=True):
            self._dropped_ahead()
        self.runners.optimizer.join()

    def skip(self, iteration: int, num_microbatches: int | None = None) -> StepResult:
        """Consume the micro-batches of the iteration numbered ``iteration`` (from 1) without
        training (``RerunConfig.iterations_to_skip``, Megatron's dummy step)."""
        self.settle()
        self.rejected = False
        self.machine.skip_iteration(_index(iteration))
        self.data.advance()
        for _ in range(num_microbatches or self.num_microbatches):
            next(self.data)
        self.data.commit()
        if self.agreement is None:
            return StepResult(skipped=True)
        self.agreement.begin()  # the exit inputs are agreed on every iteration, skipped too
        return StepResult(skipped=True, agreed=self.agreement.finish())

    def evaluate(
        self,
        data_iterator: Any,
        eval_iters: int,
        *,
        num_microbatches: int | None = None,
        each_iteration: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
    ) -> dict[str, float]:
        """Mean of every reported value over ``eval_iters`` forward-only iterations, checks
        resolved with the machine's disabled-mode semantics (a NaN raises, a spike warns).

        Returns host floats (one deliberate sync at the end).
        """
        self.settle()
        return evaluate(self, data_iterator, eval_iters, num_microbatches, each_iteration)

    @property
    def num_launched(self) -> int:
        """Look-ahead launches so far (and :attr:`num_used`: launches an iteration used)."""
        return self._lookahead.num_launched

    @property
    def num_used(self) -> int:
        return self._lookahead.num_used

    # --------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (JSON-friendly). Settles first, so the RNG and data state
        saved with it are those of the next iteration's start."""
        self.settle()
        return {"loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scaler.load_state_dict(state.get("loss_scaler", {}))

    def close(self) -> None:
        """Drop graphs and pending work (idempotent; in-process restart calls it first)."""
        if self._closed:
            return
        self._closed = True
        self._lookahead.forget()
        self.runners.close()


def _index(number: int) -> int:
    """The machine's 0-based index of the iteration numbered ``number`` (from 1)."""
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"an iteration's number counts from 1 (as logged), got {number!r}")
    return number - 1


def _trained_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """The parameters that train and their names (DDP: the inner module's names)."""
    named = [(n, p) for n, p in getattr(model, "module", model).named_parameters()]
    return [p for _, p in named if p.requires_grad], [n for n, p in named if p.requires_grad]


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
