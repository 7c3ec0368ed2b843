"""Per-rank verdicts of the rerun state machine, and its checkpointable state.

Split from ``machine.py`` to keep files small. Each verdict function looks only at this rank's
values and returns request flags; the machine then agrees on them across ranks in one collective.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from typing import Any, cast

from stalwart.distributed import collectives
from stalwart.distributed.launch_env import env_int
from stalwart.reliability.rerun.buffer import (
    ValidationRecord,
    evaluate_comparison,
    is_rejected,
)
from stalwart.reliability.rerun.core import MachineCore
from stalwart.reliability.rerun.stats import LargeValueTracker, QuickStats
from stalwart.reliability.rerun.types import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    CallKey,
    Diagnosis,
    DiagnosisSource,
    Identity,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunValidationStatus,
    RerunVerdict,
    Suspect,
    device_identity,
)

logger = logging.getLogger(__name__)
# "3" (a CUDA index) or "cpu:1" -> the index Megatron's failure line shows.
_DEVICE_INDEX = re.compile(r"(?:[a-z]+:)?(\d+)")
# Disabled-mode results and determinism statistics keep the machine's logger name (log parsers).
machine_logger = logging.getLogger("stalwart.reliability.rerun.machine")

STATE_DICT_VERSION = 1
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


class EventMixin(MachineCore):
    """Verdicts, logging and checkpoint state (a part of the machine: ``core.MachineCore``)."""

    # ------------------------------------------------------------------------------ verdicts
    def _first_rejection(self, items: list[tuple[ValidationRecord, float]]) -> bool:
        """Initial run: the first rejected call of this rank opens an event (later ones ignored)."""
        for rec, v in items:
            if not is_rejected(rec, v):
                continue
            spec = rec.spec
            self.event = Event(rec.key, spec.message, spec.fatal, spec.tolerance, v)
            if not self.injector.is_pending_for(rec.key):
                self.injector.clear()
            self._track(RerunValidationStatus.INITIAL_RUN, v, spec.message)
            logger.error(
                "Unexpected result %s on rank %d at iteration %d invocation #%d (message='%s')",
                v, self.rank, self.iteration + 1, rec.key[2], spec.message,
            )  # fmt: skip
            return True
        self.injector.clear()
        return False

    def _rerun_value(self, items: list[tuple[ValidationRecord, float]]) -> tuple[float, float]:
        """(value, comparison) of this rank's failed call in the rerun; missing = mismatch."""
        assert self.event is not None
        for rec, v in items:
            if rec.key == self.event.key:
                return v, evaluate_comparison(
                    rec.spec.comparison_func, self.event.initial_result, v
                )
        logger.warning(
            self._describe(f"validation call {self.event.key} was not made in the rerun")
        )
        return float("nan"), float("inf")

    def _first_rerun_verdict(
        self, items: list[tuple[ValidationRecord, float]]
    ) -> tuple[bool, bool, bool]:
        """After the in-place rerun: (checkpoint_requested, fatal_exit_requested, continue_requested)."""
        ev = self.event
        if ev is None:
            return False, False, False
        v, cmp = self._rerun_value(items)
        if cmp > ev.tolerance:
            self.diagnosis = RerunDiagnostic.TRANSIENT_ERROR
            self._track(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, v, ev.message)
            self._log_failure(
                "Possible transient error!",
                ev.fatal,
                f"First rerun: unexpected result is not reproducible within the tolerance "
                f"({ev.initial_result} != {v}) (message='{ev.message}')",
            )
            return False, ev.fatal, not ev.fatal
        ev.suspicious = device_identity()
        self._track(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, v, ev.message)
        self._log_failure(
            f"First rerun: unexpected result is reproducible within the tolerance "
            f"({ev.initial_result} = {v}) (message='{ev.message}'). Need to rerun on a different "
            f"GPU to verify correctness",
            ev.fatal,
        )
        return ev.fatal, False, not ev.fatal

    def _second_rerun_verdict(
        self, items: list[tuple[ValidationRecord, float]]
    ) -> tuple[bool, bool, bool]:
        """After the rerun from checkpoint: (restart_again, fatal_exit, continue) for this rank."""
        ev = self.event
        if ev is None:
            return False, False, False
        here = device_identity()
        if ev.suspicious is not None and here == ev.suspicious:
            logger.error(
                self._describe(
                    "Got rescheduled on the same GPU that produced the suspicious result; "
                    "need to resume on a different GPU"
                )
            )
            return True, False, False
        v, cmp = self._rerun_value(items)
        if cmp > ev.tolerance:
            self.diagnosis = RerunDiagnostic.PERSISTENT_ERROR
            self._track(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, v, ev.message)
            logger.warning(
                "Second rerun: unexpected result is not reproducible on a different GPU, "
                "therefore was likely incorrect (%s != %s)", ev.initial_result, v,
            )  # fmt: skip
            self._log_failure("Possible persistent error!", True, f"(message='{ev.message}')")
        else:
            self.diagnosis = RerunDiagnostic.CORRECT_RESULT
            self._track(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, v, ev.message)
            logger.warning(
                "Second rerun: unexpected result is reproducible on a different GPU, "
                "therefore it was likely correct (%s = %s)", ev.initial_result, v,
            )  # fmt: skip
            self._log_failure(
                f"Correct result (but possible Application error) ({ev.message})", True
            )
        return False, ev.fatal, not ev.fatal

    def verdict(self) -> RerunVerdict:
        """The iteration's outcome once its passes are done (logs the exit message once).

        An exit that ends an attribution carries its :class:`Diagnosis` (``rerun_verdict.json``;
        ``stalwart.reliability.exit.leave`` writes it)."""
        if self.mode is not RerunMode.VALIDATE_RESULTS:
            return RerunVerdict()
        state, diagnosis, replica = self.state, self._pending_diagnosis, self._replica_detail
        if state is RerunState.RERUNNING_IN_PLACE:
            self._log0("Exiting now. The job can be resumed from a previous checkpoint.")
            return RerunVerdict(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False, diagnosis, replica)
        if state is RerunState.WILL_RERUN_FROM_CHECKPOINT and diagnosis is not None:
            self._log0(
                f"Saving a checkpoint and exiting now: {diagnosis.diagnosis} diagnosed in this "
                "launch; a relaunch without the suspect devices trains on from it."
            )
            return RerunVerdict(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, True, diagnosis, replica)
        if state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._log0(
                "Saving a checkpoint and exiting now. Please resume the job from this checkpoint "
                "to rerun the last iteration on a different GPU and establish a diagnostic."
            )
            return RerunVerdict(EXIT_CODE_RESUME_TO_DISAMBIGUATE, checkpoint=True)
        if state is RerunState.RERUNNING_FROM_CHECKPOINT:
            self._log0("Exiting now. A checkpoint at the last iteration already exists.")
            return RerunVerdict(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, diagnosis=diagnosis)
        if state is RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            self._log0(
                "Exiting now. Please resume the job from the same checkpoint on another GPU."
            )
            return RerunVerdict(EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        return RerunVerdict()

    def _checkpoint_diagnosis(self) -> Diagnosis | None:
        """The diagnosis of the rerun from a checkpoint (collective: every rank calls it once
        the ranks agreed on the fatal exit). A persistent error on any rank wins."""
        ev = self.event
        mine = (
            self.diagnosis.value if self.diagnosis is not None else None,
            list(ev.suspicious) if ev is not None and ev.suspicious else None,
            ev.message if ev is not None else "",
            self.rank,
        )
        gathered = cast(
            "list[tuple[str | None, list[str] | None, str, int]]",
            collectives.all_gather_objects(mine, self.process_group),
        )
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
            self.iteration, kind, suspects, message, DiagnosisSource.RERUN_FROM_CHECKPOINT,
            self.iteration,
        )  # fmt: skip

    def _finish_event(self) -> None:
        """A non-fatal event is over: forget it and its injection so injection can continue."""
        self.event = None
        self.injector.clear()

    def forget_rerun_from_checkpoint(self) -> None:
        """Drop a loaded "rerun this iteration from the checkpoint" mark: a rerun verdict has
        settled it (`stalwart.reliability.rerun.verdict_file`); training goes on normally."""
        self._finish_event()
        self.state = RerunState.NOT_RUNNING_YET
        self._awaiting_exit = False
        self._pending_diagnosis = None
        self._replica_detail = ""

    # ------------------------------------------------------------------------------ logging
    def _where(self) -> tuple[str, str, str]:
        """(node, device index, the device id in parentheses when it is not the index):
        Megatron's lines name a CUDA device index; a simulated or CPU device id follows."""
        node, device = device_identity()
        digits = _DEVICE_INDEX.fullmatch(device)
        index = digits.group(1) if digits else str(env_int("LOCAL_RANK", 0))
        return node, index, f" (device {device})" if device != index else ""

    def _describe(self, message: str) -> str:
        """Megatron's form of the other messages (disabled mode's ``Unexpected result``):
        ``Rank R, node N, device D, iteration I: {message}``."""
        node, index, where = self._where()
        return (
            f"Rank {self.rank}, node {node}, device {index}, "
            f"iteration {self.iteration + 1}: {message}{where}"
        )

    def _log_failure(self, message: str, fatal: bool, detail: str = "") -> None:
        """Megatron's failure line, ``Rank R, node N, device D, iteration #I: {message}!``
        (ERROR when fatal, else WARNING; a message ending in "!" gives Megatron's "!!", e.g.
        ``Possible transient error!!``). D is the device index (a simulated or CPU device
        id follows in parentheses); ``detail`` (what was seen) follows after a space."""
        node, index, where = self._where()
        line = (
            f"Rank {self.rank}, node {node}, device {index}, iteration #{self.iteration + 1}: "
            f"{message}!{where}"
        )
        (logger.error if fatal else logger.warning)(f"{line} {detail}" if detail else line)

    def _log0(self, message: str) -> None:
        if self.rank == 0:
            logger.warning(message)

    def _track(self, status: RerunValidationStatus, result: float, message: str) -> None:
        if self.tracker is not None:
            self.tracker.write(
                identity=device_identity(),
                rank=self.rank,
                iteration=self.iteration,
                status=status,
                result=result,
                message=message,
            )

    # --------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state, identical on every rank (collective: call it on all ranks).

        JSON-friendly (strings, numbers, lists, dicts). Always the same structure (steady state
        included). ``ranks[r]`` holds rank r's failed call, initial result, suspicious identity,
        identity at save time, injector state and large-value windows (host and device);
        gathered with one ``all_gather_object``. The data position is not included: the data
        iterator's own state gives the start of ``iteration``.
        """
        event = None
        if self.event is not None:
            event = _jsonable(asdict(self.event))
        mine = {
            "event": event,
            "identity": list(device_identity()),
            "injector": self.injector.state_dict(),
            "large_values": {k: [t.count, t.max_value] for k, t in self._large.items()},
            # Deliberate sync (checkpoint time): the device windows of the in-buffer checks.
            "device_large_values": (
                self._buffer.tracker_state() if self._buffer is not None else {}
            ),
        }
        return {
            "version": STATE_DICT_VERSION,
            "mode": self.mode.value,
            "state": self.state.name,
            "iteration": self.iteration,
            "world_size": self.world_size,
            "ranks": collectives.all_gather_objects(mine, self.process_group),
        }

    def load_state_dict(self, sd: dict[str, Any] | None, world_size: int | None = None) -> None:
        """Restore after a restart. Ignored (with a warning) when the world size changed, when this
        machine is disabled, or when the checkpoint was taken in steady state (only the
        large-value windows are restored then). The mode given now always wins."""
        if not sd:
            return
        expected = self.world_size if world_size is None else world_size
        if sd.get("world_size") != expected:
            logger.warning(
                "World size changed (%s -> %s): rerun state ignored", sd.get("world_size"), expected
            )
            return
        if self.mode is RerunMode.DISABLED:
            logger.warning("Rerun state machine disabled; ignoring its checkpointed state")
            return
        mine = sd["ranks"][self.group_rank]
        self._large = {k: LargeValueTracker(c, m) for k, (c, m) in mine["large_values"].items()}
        device_windows = mine.get("device_large_values") or {}
        if device_windows:
            self._load_device_windows(device_windows)
        state = RerunState[sd["state"]]
        if state is not RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return
        if self.mode is not RerunMode.VALIDATE_RESULTS:
            logger.warning("Checkpoint awaits a rerun but mode is %s: ignored", self.mode.value)
            return
        ev = mine["event"]
        if ev is not None:
            ev = Event(**ev)
            ev.key = tuple(ev.key)  # type: ignore[assignment]
            ev.suspicious = tuple(ev.suspicious) if ev.suspicious else None  # type: ignore[assignment]
        self.event = ev
        self.injector.load_state_dict(mine["injector"])
        self.state = state
        self.iteration = int(sd["iteration"])
        self._awaiting_exit = False

    def after_load(self, checkpoint_path: str) -> None:
        """After its checkpoint was loaded (``Checkpointer.load`` calls it; collective): apply
        the save directory's ``rerun_verdict.json`` (refuse a suspect device with
        ``SuspectDeviceError``, or drop a settled rerun mark and train on)."""
        from stalwart.reliability.rerun.verdict_file import apply_verdict

        apply_verdict(self, checkpoint_path)

    # --------------------------------------------------------------- disabled mode and stats
    def _apply_without_rerun(self, items: list[tuple[ValidationRecord, float]]) -> None:
        """Disabled-mode semantics: fatal rejections raise RuntimeError, others warn."""
        errors = []
        for rec, v in items:
            if not is_rejected(rec, v):
                continue
            self._track(RerunValidationStatus.RERUN_DISABLED, v, rec.spec.message)
            text = self._describe(f"Unexpected result {v} (message='{rec.spec.message}')")
            if rec.spec.fatal:
                errors.append(text)
            else:
                machine_logger.warning(text)
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
        machine_logger.warning(self.last_report)

    def determinism_report(self) -> str:
        """Percentiles of the relative difference between the two runs, per validation call."""
        lines = ["Stats on computation determinism in validation calls"]
        for message, qs in sorted(self.stats.items()):
            lines.append(f"  From validation call '{message}': {qs.print_stats()}")
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """Tuples as lists, recursively (checkpoint state must be JSON-friendly)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
