"""The rerun state machine: detect unexpected results and attribute them by re-running.

Per iteration the loop does (see :meth:`RerunStateMachine.should_run_forward_backward`)::

    while sm.should_run_forward_backward(data_iterator, iteration=it):   # 1 or 2 passes
        zero grads; forward/backward calling sm.validate_result(...)       # records only
    should_checkpoint, should_exit, exit_code = sm.should_checkpoint_and_exit()
    if should_exit: save a checkpoint if should_checkpoint; exit(exit_code)  # no optimizer step
    optimizer.step()

``validate_result`` never syncs. The second call of ``should_run_forward_backward`` reads every
recorded value in one deliberate host sync, evaluates the checks on the host, and agrees with the
other ranks in one collective before changing state.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stalwart.distributed import collectives
from stalwart.reliability.rerun.buffer import (
    CheckSpec,
    ValidationBuffer,
    ValidationRecord,
    as_scalar,
    evaluate_comparison,
    evaluate_rejection,
    host_predicate,
    read_values,
)
from stalwart.reliability.rerun.data_iterator import RerunDataIterator
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.rng import RngStateTracker, capture_rng_state, restore_rng_state
from stalwart.reliability.rerun.stats import (
    LargeValueTracker,
    QuickStats,
    compare_floats,
    host_float,
)
from stalwart.reliability.rerun.tracker import TrackerFile
from stalwart.reliability.rerun.types import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    CallKey,
    Identity,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunValidationStatus,
    device_identity,
)
from stalwart.reliability.rerun.verdicts import Event, EventMixin

logger = logging.getLogger(__name__)

_RERUNS = (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT)


@dataclass
class _Saved:
    rng: dict[str, Any]
    extra: Any


class RerunStateMachine(EventMixin):
    """Instance-scoped rerun state machine (no singleton); see the module docstring for the loop.

    Args:
        mode: a :class:`RerunMode` or its string (``report_stats`` is an alias).
        error_injector: a :class:`RerunErrorInjector`; None means no injection.
        result_rejected_tracker_filename: file to append one line per validation event to.
        state_save_func: returns extra state to snapshot before each iteration (e.g. grad scaler).
        state_restore_func: restores what ``state_save_func`` returned before a rerun.
        process_group: group whose ranks must agree (default: world).
        rng_tracker: extra named generators to snapshot with python/numpy/torch/CUDA ones.
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
        self.state = RerunState.NOT_RUNNING_YET
        self.iteration = -1
        self.diagnosis: RerunDiagnostic | None = None
        self.event: Event | None = None
        self.stats: dict[str, QuickStats] = {}
        self.last_report: str | None = None
        self._pending: list[ValidationRecord] = []
        self._seq: dict[tuple[str, str], int] = {}
        self._buffers: list[ValidationBuffer] = []
        self._saved: _Saved | None = None
        self._saved_results: dict[CallKey, float] = {}
        self._large: dict[str, LargeValueTracker] = {}
        self._awaiting_exit = False
        self._announced = False
        self._iteration_set = False
        logger.info("RerunStateMachine initialized in mode %s", self.mode.value)

    # ----------------------------------------------------------------- identity / configuration
    @property
    def rank(self) -> int:
        return dist.get_rank() if collectives.is_initialized() else 0

    @property
    def group_rank(self) -> int:
        return dist.get_rank(self.process_group) if collectives.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if collectives.is_initialized() else 1

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

    def attach_buffer(self, buffer: ValidationBuffer) -> None:
        """Read ``buffer`` in the per-iteration sync (checks written by a captured graph)."""
        self._buffers.append(buffer)

    def register_generator(
        self, name: str, get: Callable[[], Any], set: Callable[[Any], object]
    ) -> None:
        """Snapshot/restore an extra RNG with every iteration (e.g. a tensor-parallel tracker)."""
        self.rng.register_generator(name, get, set)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Disable reruns (e.g. for evaluation). Checks recorded inside are resolved at exit with
        ``disabled`` semantics: one sync, fatal rejections raise ``RuntimeError``, others warn."""
        saved = (self.mode, self._pending, self._seq)
        self.mode, self._pending, self._seq = RerunMode.DISABLED, [], {}
        try:
            yield
            self.resolve()
        finally:
            self.mode, self._pending, self._seq = saved

    # --------------------------------------------------------------------------- validation
    def validate_result(
        self,
        result: torch.Tensor | float,
        rejection_func: Callable[..., Any] | None,
        message: str,
        comparison_func: Callable[..., Any] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Record a check of a scalar ``result``; never syncs (evaluated at the next sync point).

        ``rejection_func(value) -> bool`` says the result is unexpected; ``comparison_func(a, b)``
        (default :func:`compare_floats`) measures how far a rerun's value is from the initial one;
        the result is reproducible when that is ``<= tolerance``. Non-fatal checks never stop the
        job. Must be called between ``should_run_forward_backward`` calls unless disabled.
        """
        if self.mode is not RerunMode.DISABLED and self.state is RerunState.NOT_RUNNING_YET:
            raise RuntimeError(
                "validate_result called outside the forward-backward pass; "
                "wrap evaluation in `with rerun_state_machine.disabled():`"
            )
        spec = CheckSpec(
            message, rejection_func, comparison_func or compare_floats, tolerance, fatal
        )
        key = self._next_key("", message)
        value = as_scalar(result)
        injected = self._inject_decision(key)
        if injected:
            value = (
                torch.full_like(value, math.nan) if isinstance(value, torch.Tensor) else math.nan
            )
        self._pending.append(ValidationRecord(key, spec, value, injected))

    @host_predicate
    def is_unexpectedly_large(
        self,
        result: torch.Tensor | float,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """True when ``|result| >= threshold * max`` of the first ``num_samples`` values of ``context``.

        Meant as a rejection function (``functools.partial(sm.is_unexpectedly_large, threshold=10,
        context="loss")``): the machine then calls it with host floats at its sync point. Called
        directly with a device tensor it reads it (a sync). NaN/Inf return False. ``resample``
        restarts the sampling window.
        """
        tracker = self._large.setdefault(context, LargeValueTracker())
        if resample:
            tracker.count, tracker.max_value = 0, 0.0
        return tracker.check(host_float(result), threshold, context, num_samples)

    def skip_iteration(self, iteration: int) -> None:
        """The loop skips ``iteration`` (``--iterations-to-skip``) without running it.

        A rerun from checkpoint still pending for that iteration (restored from the checkpoint of
        an exit 16) is dropped with a warning; otherwise it would replay a later iteration's data
        and compare it with this one's result.
        """
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
        items = self._read(include_buffers=False)
        self._pending, self._seq = [], {}
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
            return self._after_rerun_from_checkpoint()
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
        if self.mode is not RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        state = self.state
        if state is RerunState.RERUNNING_IN_PLACE:
            self._log0("Exiting now. The job can be resumed from a previous checkpoint.")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._log0(
                "Saving a checkpoint and exiting now. Please resume the job from this checkpoint "
                "to rerun the last iteration on a different GPU and establish a diagnostic."
            )
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if state is RerunState.RERUNNING_FROM_CHECKPOINT:
            self._log0("Exiting now. A checkpoint at the last iteration already exists.")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            self._log0(
                "Exiting now. Please resume the job from the same checkpoint on another GPU."
            )
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    def _start_iteration(
        self, iterators: list[RerunDataIterator[Any]], iteration: int | None
    ) -> bool:
        if iteration is not None:
            self.iteration = int(iteration)
        elif not self._iteration_set:
            self.iteration += 1
        self._iteration_set = False
        for it in iterators:
            it.advance()
        if self.mode is not RerunMode.DISABLED:
            if self.mode is RerunMode.VALIDATE_RESULTS and not self._announced:
                logger.warning("Result validation enabled")
                self._announced = True
            extra = self.state_save_func() if self.state_save_func is not None else None
            self._saved = _Saved(capture_rng_state(self.rng), extra)
        self._enter(RerunState.INITIAL_RUN)
        return True

    def _after_initial_run(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self._read()
        if self.mode is RerunMode.DISABLED:
            self.state = RerunState.NOT_RUNNING_YET
            self._apply_without_rerun(items)
            return False
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._apply_without_rerun(items)
            self._saved_results = {rec.key: v for rec, v in items}
            self._begin_rerun(iterators)
            return True
        rejected = self._first_rejection(items)
        (any_rejected,) = collectives.all_reduce_any([rejected], self.process_group)
        if not any_rejected:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        self._log0(
            f"Need to rerun iteration {self.iteration + 1} to check the result is reproducible"
        )
        self._begin_rerun(iterators)
        return True

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator[Any]]) -> bool:
        items = self._read()
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._record_stats(items)
            self.state = RerunState.NOT_RUNNING_YET
            return False
        ckpt, fatal, _cont = collectives.all_reduce_any(
            list(self._first_rerun_verdict(items)), self.process_group
        )
        # Fatal beats non-fatal on every rank: a "continue" never overrides a fatal request.
        if ckpt or fatal:
            self._restore_state()
            for it in iterators:
                it.rewind()
            self._awaiting_exit = True
            if ckpt:
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            return False
        self._log0("Continuing normal execution because the failed validation was not fatal")
        self._finish_event()
        self.state = RerunState.NOT_RUNNING_YET
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

    def _after_rerun_from_checkpoint(self) -> bool:
        items = self._read()
        again, fatal, _ = collectives.all_reduce_any(
            list(self._second_rerun_verdict(items)), self.process_group
        )
        if again:
            self._log0("Need to restart the job from the same checkpoint on a different GPU")
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            self._awaiting_exit = True
            return False
        if fatal:
            self._awaiting_exit = True
            return False
        self._log0("Continuing normal execution because the failed validation was not fatal")
        self._finish_event()
        self.state = RerunState.NOT_RUNNING_YET
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

    def _next_key(self, scope: str, message: str) -> CallKey:
        seq = self._seq.get((scope, message), 0) + 1
        self._seq[(scope, message)] = seq
        return scope, message, seq

    def _identity(self) -> Identity:
        return device_identity()

    def _inject_decision(self, key: CallKey) -> bool:
        if self.mode is not RerunMode.VALIDATE_RESULTS or not self.injector.enabled:
            return False
        if self.state is RerunState.INITIAL_RUN:
            return self.injector.maybe_inject(key, self.iteration, self.rank, self._identity())
        if self.state in _RERUNS:
            return self.injector.should_corrupt(key, self.state, self._identity())
        return False

    def _enter(self, state: RerunState) -> None:
        """Start a pass: new state, empty record list, buffers cleared with their injection masks."""
        self.state = state
        self._pending, self._seq = [], {}
        for buf in self._buffers:
            buf.begin([self._inject_decision(k) for k in buf.keys])

    def _begin_rerun(self, iterators: list[RerunDataIterator[Any]]) -> None:
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

    def _read(self, include_buffers: bool = True) -> list[tuple[ValidationRecord, float]]:
        return read_values(self._pending, self._buffers if include_buffers else [])

    def _apply_without_rerun(self, items: list[tuple[ValidationRecord, float]]) -> None:
        """Disabled-mode semantics: fatal rejections raise RuntimeError, others warn."""
        errors = []
        for rec, v in items:
            if not evaluate_rejection(rec.spec.rejection_func, v):
                continue
            self._track(RerunValidationStatus.RERUN_DISABLED, v, rec.spec.message)
            text = self._describe(f"Unexpected result {v} (message='{rec.spec.message}')")
            if rec.spec.fatal:
                errors.append(text)
            else:
                logger.warning(text)
        if errors:
            raise RuntimeError("; ".join(errors))

    def _record_stats(self, items: list[tuple[ValidationRecord, float]]) -> None:
        for rec, v in items:
            initial = self._saved_results.get(rec.key)
            if initial is None:
                raise RuntimeError(f"Result from the initial run missing for {rec.key}")
            diff = evaluate_comparison(rec.spec.comparison_func, initial, v)
            self.stats.setdefault(rec.spec.message, QuickStats()).record(diff)
        self._saved_results = {}
        if self.iteration % self.REPORTING_INTERVAL_ITERATIONS == 0:
            self._report_stats()

    def _report_stats(self) -> None:
        gathered = collectives.all_gather_objects(self.stats, self.process_group)
        if self.group_rank != 0:
            self.stats = {}
            return
        for other in gathered[1:]:
            for message, qs in other.items():  # type: ignore[attr-defined]
                self.stats.setdefault(message, QuickStats()).combine([qs])
        self.last_report = self.determinism_report()
        logger.warning(self.last_report)

    def determinism_report(self) -> str:
        """Percentiles of the relative difference between the two runs, per validation call."""
        lines = ["Stats on computation determinism in validation calls"]
        for message, qs in sorted(self.stats.items()):
            lines.append(f"  From validation call '{message}': {qs.print_stats()}")
        return "\n".join(lines)
