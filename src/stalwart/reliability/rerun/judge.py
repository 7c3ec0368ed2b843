"""This rank's failed call and its diagnosis: :class:`EventJudge` applies the pure verdicts
(``verdicts``) to what a pass read, keeps the event they open, and writes their lines."""

from __future__ import annotations

import logging
from typing import Any, cast

from stalwart.distributed import collectives
from stalwart.reliability.rerun.checks.rules import is_rejected
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.types import (
    Diagnosis,
    RerunDiagnostic,
    RerunValidationStatus,
    device_identity,
)
from stalwart.reliability.rerun.verdicts import (
    NO_REQUESTS,
    Event,
    Items,
    Requests,
    checkpoint_diagnosis,
    first_rejection,
    first_rerun_requests,
    rerun_value,
    second_rerun_requests,
)

# The verdict lines keep the logger they always had; disabled-mode results the machine's.
logger = logging.getLogger("stalwart.reliability.rerun.verdicts")
machine_logger = logging.getLogger("stalwart.reliability.rerun.machine")
_STATUS = RerunValidationStatus


class EventJudge:
    """Owns this rank's event (its first rejected call, carried across the reruns and the
    restart) and the diagnosis reached for it.

    Args:
        injector: the machine's error injector (an event keeps its pending injection).
        reporter: the machine's place in its group, its lines and tracker file.
    """

    def __init__(self, injector: RerunErrorInjector, reporter: Reporter) -> None:
        self._injector = injector
        self._reporter = reporter
        self.event: Event | None = None
        self.diagnosis: RerunDiagnostic | None = None

    def open(self, items: Items, iteration: int) -> bool:
        """Initial run: the first rejected call of this rank opens the event (later ones are
        ignored); whether one did."""
        found = first_rejection(items)
        if found is None:
            self._injector.clear()
            return False
        rec, v = found
        spec = rec.spec
        self.event = Event(rec.key, spec.message, spec.fatal, spec.tolerance, v)
        if not self._injector.is_pending_for(rec.key):
            self._injector.clear()
        self._reporter.track(iteration, _STATUS.INITIAL_RUN, v, spec.message)
        logger.error(
            "Unexpected result %s on rank %d at iteration %d invocation #%d (message='%s')",
            v,
            self._reporter.rank,
            iteration + 1,
            rec.key[2],
            spec.message,
        )
        return True

    def _rerun_value(self, ev: Event, items: Items, iteration: int) -> tuple[float, float]:
        """(value, comparison) of the event's call in the rerun; missing = mismatch."""
        found = rerun_value(ev, items)
        if found is None:
            line = f"validation call {ev.key} was not made in the rerun"
            logger.warning(self._reporter.describe(iteration, line))
            return float("nan"), float("inf")
        return found

    def first_rerun(self, items: Items, iteration: int) -> Requests:
        """After the in-place rerun: this rank's requests (a reproduced result marks this
        device suspicious)."""
        ev = self.event
        if ev is None:
            return NO_REQUESTS
        v, cmp = self._rerun_value(ev, items, iteration)
        reproducible = not cmp > ev.tolerance
        requests, diagnosis = first_rerun_requests(ev, reproducible)
        report = self._reporter
        if not reproducible:
            self.diagnosis = diagnosis
            report.track(iteration, _STATUS.FIRST_RERUN_NOT_REPRODUCIBLE, v, ev.message)
            report.log_failure(
                iteration,
                "Possible transient error!",
                ev.fatal,
                f"First rerun: unexpected result is not reproducible within the tolerance "
                f"({ev.initial_result} != {v}) (message='{ev.message}')",
            )
            return requests
        ev.suspicious = device_identity()
        report.track(iteration, _STATUS.FIRST_RERUN_REPRODUCIBLE, v, ev.message)
        report.log_failure(
            iteration,
            f"First rerun: unexpected result is reproducible within the tolerance "
            f"({ev.initial_result} = {v}) (message='{ev.message}'). Need to rerun on a "
            f"different GPU to verify correctness",
            ev.fatal,
        )
        return requests

    def second_rerun(self, items: Items, iteration: int) -> Requests:
        """After the rerun from a checkpoint: this rank's requests."""
        ev = self.event
        if ev is None:
            return NO_REQUESTS
        report = self._reporter
        if ev.suspicious is not None and device_identity() == ev.suspicious:
            line = (
                "Got rescheduled on the same GPU that produced the suspicious result; "
                "need to resume on a different GPU"
            )
            logger.error(report.describe(iteration, line))
            return True, False, False
        v, cmp = self._rerun_value(ev, items, iteration)
        reproducible = not cmp > ev.tolerance
        requests, self.diagnosis = second_rerun_requests(ev, reproducible)
        status = (
            _STATUS.SECOND_RERUN_REPRODUCIBLE
            if reproducible
            else _STATUS.SECOND_RERUN_NOT_REPRODUCIBLE
        )
        report.track(iteration, status, v, ev.message)
        report.log_repeat_verdict(
            logger,
            iteration,
            "Second rerun",
            "a different GPU",
            reproducible=reproducible,
            values=(ev.initial_result, v),
            message=ev.message,
            fatal=True,
        )
        return requests

    def checkpoint_diagnosis(self, iteration: int) -> Diagnosis | None:
        """The diagnosis of the rerun from a checkpoint (collective: every rank calls it once
        the ranks agreed on the fatal exit)."""
        ev, diagnosis = self.event, self.diagnosis
        row = (
            diagnosis.value if diagnosis is not None else None,
            list(ev.suspicious) if ev is not None and ev.suspicious else None,
            ev.message if ev is not None else "",
            self._reporter.rank,
        )
        gathered = collectives.all_gather_objects(row, self._reporter.process_group)
        return checkpoint_diagnosis(cast("list[Any]", gathered), iteration)

    def finish(self) -> None:
        """A non-fatal event is over: forget it and its injection so injection can continue."""
        self.event = None
        self._injector.clear()

    def without_rerun(self, items: Items, iteration: int) -> None:
        """Disabled-mode semantics: fatal rejections raise RuntimeError, others warn."""
        errors = []
        for rec, v in items:
            if not is_rejected(rec, v):
                continue
            message = rec.spec.message
            self._reporter.track(iteration, _STATUS.RERUN_DISABLED, v, message)
            text = self._reporter.describe(
                iteration, f"Unexpected result {v} (message='{message}')"
            )
            if rec.spec.fatal:
                errors.append(text)
            else:
                machine_logger.warning(text)
        if errors:
            raise RuntimeError("; ".join(errors))
