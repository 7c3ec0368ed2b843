"""The rerun machine's verdicts, as pure functions of what the passes read.

Each function looks only at its arguments (this rank's values, or what the ranks gathered) and
returns what to request or report; the machine logs, agrees across ranks in one collective and
changes state. Also the checkpoint form of the machine's event (JSON-friendly).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from stalwart.reliability.rerun.checks.rules import (
    ValidationRecord,
    evaluate_comparison,
    is_rejected,
)
from stalwart.reliability.rerun.types import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    CallKey,
    Diagnosis,
    DiagnosisSource,
    Identity,
    RerunDiagnostic,
    RerunState,
    RerunVerdict,
    Suspect,
)

Items = list[tuple[ValidationRecord, float]]
"""The values of one pass's records, as the read returns them."""

# Diagnoses a rerun from a checkpoint can reach, the one that wins first.
_DIAGNOSES = (RerunDiagnostic.PERSISTENT_ERROR.value, RerunDiagnostic.CORRECT_RESULT.value)


@dataclass
class Event:
    """The failed validation call of this rank, carried across the reruns (and the restart)."""

    key: CallKey
    message: str
    fatal: bool
    tolerance: float
    initial_result: float
    suspicious: Identity | None = None


Requests = tuple[bool, bool, bool]
"""This rank's requests after a rerun, agreed across ranks (element-wise OR) in one
collective: after the in-place rerun ``(checkpoint, fatal exit, continue)``, after the rerun
from a checkpoint ``(restart again, fatal exit, continue)``."""
NO_REQUESTS: Requests = (False, False, False)


def first_rejection(items: Items) -> tuple[ValidationRecord, float] | None:
    """The first rejected call of a pass (later ones are ignored), with its value."""
    for rec, v in items:
        if is_rejected(rec, v):
            return rec, v
    return None


def rerun_value(event: Event, items: Items) -> tuple[float, float] | None:
    """(value, comparison with the initial result) of the event's call in a rerun; None when
    the rerun did not make the call (a mismatch)."""
    for rec, v in items:
        if rec.key == event.key:
            return v, evaluate_comparison(rec.spec.comparison_func, event.initial_result, v)
    return None


def first_rerun_requests(
    event: Event, reproducible: bool
) -> tuple[Requests, RerunDiagnostic | None]:
    """After the in-place rerun: a result not reproduced was a transient error (a fatal check
    exits, else training goes on); a reproduced one asks for a checkpoint when fatal (the rerun
    on another device decides), else goes on."""
    if not reproducible:
        return (False, event.fatal, not event.fatal), RerunDiagnostic.TRANSIENT_ERROR
    return (event.fatal, False, not event.fatal), None


def second_rerun_requests(event: Event, reproducible: bool) -> tuple[Requests, RerunDiagnostic]:
    """After the rerun from a checkpoint on another device: a result not reproduced was a
    persistent error of the suspicious device, a reproduced one a correct result. (Back on the
    suspicious device, the machine restarts once more instead.)"""
    diagnosis = RerunDiagnostic.CORRECT_RESULT if reproducible else RerunDiagnostic.PERSISTENT_ERROR
    return (False, event.fatal, not event.fatal), diagnosis


class TransientAction(enum.Enum):
    """What the iteration does after an in-place rerun in which a rejection did not reproduce."""

    MEGATRON = "megatron"  # the requests decide, as in Megatron (a fatal check exits 17)
    CONTINUE = "continue"  # apply the rerun's result (it is the fault-free one) and go on
    SUSPECT = "suspect"  # a device is over its transient budget: save, exit 17 naming it


def transient_action(
    continues: bool, transient: bool, dirty: bool, over_budget: bool, reproduced_anywhere: bool
) -> TransientAction:
    """After the in-place rerun, from the flags agreed across ranks (``--rerun-transient-policy``,
    ``stalwart.reliability.rerun.remedies``). ``continues``: the policy is ``continue``;
    ``transient``: some rank's rejection did not reproduce; ``dirty``: some rank's rerun
    rejected a call itself; ``over_budget``: some device has more transients than its budget;
    ``reproduced_anywhere``: some rank's rejection did reproduce (it must be attributed)."""
    if not (continues and transient):
        return TransientAction.MEGATRON
    if over_budget:
        return TransientAction.SUSPECT
    if dirty or reproduced_anywhere:
        return TransientAction.MEGATRON
    return TransientAction.CONTINUE


def spike_rewinds(spike: bool, fatal: bool, allowed: bool) -> bool:
    """Whether a spiky loss reproduced by the rerun (the in-place rerun with no peer to replay
    it on, or a peer replica: an application error, the data) rewinds instead of training on
    (``--rewind-on-spike``): a spike, no fatal request on any rank (those exit first), and a
    rewind left (``allowed``: the loop can rewind and ``--max-rewinds`` is not reached)."""
    return spike and not fatal and allowed


def exit_verdict(
    state: RerunState, diagnosis: Diagnosis | None, replica: str
) -> tuple[RerunVerdict, str | None]:
    """The iteration's outcome in ``state`` (validate mode) and the line to log once, if any."""
    failed = EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    if state is RerunState.RERUNNING_IN_PLACE:
        line = "Exiting now. The job can be resumed from a previous checkpoint."
        return RerunVerdict(failed, False, diagnosis, replica), line
    if state is RerunState.WILL_RERUN_FROM_CHECKPOINT and diagnosis is not None:
        line = (
            f"Saving a checkpoint and exiting now: {diagnosis.diagnosis} diagnosed in this "
            "launch; a relaunch without the suspect devices trains on from it."
        )
        return RerunVerdict(failed, True, diagnosis, replica), line
    if state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
        line = (
            "Saving a checkpoint and exiting now. Please resume the job from this checkpoint "
            "to rerun the last iteration on a different GPU and establish a diagnostic."
        )
        return RerunVerdict(EXIT_CODE_RESUME_TO_DISAMBIGUATE, checkpoint=True), line
    if state is RerunState.RERUNNING_FROM_CHECKPOINT:
        line = "Exiting now. A checkpoint at the last iteration already exists."
        return RerunVerdict(failed, diagnosis=diagnosis), line
    if state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
        line = "Exiting now. Please resume the job from the same checkpoint on another GPU."
        return RerunVerdict(EXIT_CODE_RESUME_TO_DISAMBIGUATE), line
    return RerunVerdict(), None


def checkpoint_diagnosis(
    gathered: list[tuple[str | None, list[str] | None, str, int]], iteration: int
) -> Diagnosis | None:
    """The diagnosis of the rerun from a checkpoint from every rank's row (its diagnosis, its
    suspicious identity, its failed call's message, its rank): a persistent error on any rank
    wins."""
    found = {d for d, _, _, _ in gathered if d in _DIAGNOSES}
    if not found:
        return None
    kind = min(found, key=_DIAGNOSES.index)
    suspects = tuple(
        Suspect(rank, str(s[0]), str(s[1]))
        for d, s, _, rank in gathered
        if d == kind == RerunDiagnostic.PERSISTENT_ERROR.value and s is not None
    )
    message = next((m for d, _, m, _ in gathered if d == kind), "")
    return Diagnosis(
        iteration, kind, suspects, message, DiagnosisSource.RERUN_FROM_CHECKPOINT, iteration
    )


def event_to_json(event: Event | None) -> Any:
    """The checkpoint form of ``event`` (tuples as lists)."""
    return None if event is None else _jsonable(asdict(event))


def event_from_json(raw: Any) -> Event | None:
    """Inverse of :func:`event_to_json`."""
    if raw is None:
        return None
    ev = Event(**raw)
    ev.key = tuple(ev.key)  # type: ignore[assignment]
    ev.suspicious = tuple(ev.suspicious) if ev.suspicious else None  # type: ignore[assignment]
    return ev


def _jsonable(value: Any) -> Any:
    """Tuples as lists, recursively (checkpoint state must be JSON-friendly)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
