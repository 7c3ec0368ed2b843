"""The path forward after the rerun machine's diagnosis: ``rerun_verdict.json``.

Megatron's protocol ends a persistent error with exit 17 and leaves the checkpoint marked "rerun
this iteration from here on another GPU": every later launch resumes it, reruns the iteration
and exits 17 again, so the operator has no way to continue on good hardware. Here the diagnosis
is recorded next to the checkpoint's tracker, in ``<root>/rerun_verdict.json``::

    {"checkpoint": "iter_0000003", "iteration": 3, "diagnosis": "persistent_error",
     "suspects": [["node7", "3"]], "message": "...", "time": "2026-...Z"}

(``iteration`` counts completed iterations: the failed iteration is logged as ``iteration + 1``;
``suspects`` are the (node, device) identities that reproduced the bad value in place.) A later
launch that resumes that checkpoint (still marked for the rerun) then:

* on a suspect device (any rank; ``STALWART_DEVICE_ID`` simulates devices): is refused before
  training with one line and exit code 16 (``SuspectDeviceError``: schedule it elsewhere);
* elsewhere: drops the rerun mark and trains on from the checkpoint, past the failed iteration;
* after a ``correct_result`` diagnosis (the value was reproduced on another device, so the
  hardware is fine and the run itself produces it): trains on as well; if the same check fails
  again, the machine diagnoses it afresh (skip it with ``--iterations-to-skip``).

The file is plain JSON checked field by field (reading it runs nothing); an unreadable or
unrelated file changes nothing (the old behaviour: the rerun from the checkpoint).

Example (in a loop; both calls are collective)::

    record_verdict(machine, "/ckpt/iter_0000003", write=rank == 0)   # at the exit-17 diagnosis
    apply_verdict(machine, "/ckpt/iter_0000003")                      # after loading that checkpoint
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

from stalwart.distributed import collectives
from stalwart.reliability.rerun.types import (
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Identity,
    RerunDiagnostic,
    RerunState,
    device_identity,
)

logger = logging.getLogger(__name__)

VERDICT_FILENAME = "rerun_verdict.json"
_DIAGNOSES = (RerunDiagnostic.PERSISTENT_ERROR.value, RerunDiagnostic.CORRECT_RESULT.value)


class SuspectDeviceError(ValueError):
    """This launch runs on a device that a rerun verdict names as faulty; the CLI exits 16."""

    exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE


@dataclass(frozen=True)
class RerunVerdict:
    """The content of ``rerun_verdict.json`` (see module docstring)."""

    checkpoint: str
    iteration: int
    diagnosis: str
    suspects: list[Identity]
    message: str
    time: str


def record_verdict(machine: Any, checkpoint_path: str, *, write: bool) -> RerunVerdict | None:
    """After the rerun from ``checkpoint_path`` diagnosed the event (the exit-17 path): the
    verdict, written next to the checkpoint's tracker when ``write`` (rank 0). Collective
    whenever the machine is in that state (the same on every rank); None otherwise."""
    if machine.state is not RerunState.RERUNNING_FROM_CHECKPOINT:
        return None
    event = machine.event
    mine = (
        machine.diagnosis.value if machine.diagnosis is not None else None,
        list(event.suspicious) if event is not None and event.suspicious else None,
        event.message if event is not None else "",
    )
    gathered = cast(
        "list[tuple[str | None, list[str] | None, str]]",
        collectives.all_gather_objects(mine, machine.process_group),
    )
    diagnoses = {d for d, _, _ in gathered if d in _DIAGNOSES}
    if not diagnoses:
        return None
    diagnosis = min(diagnoses, key=_DIAGNOSES.index)  # a persistent error on any rank wins
    suspects = [(str(s[0]), str(s[1])) for d, s, _ in gathered if d == diagnosis and s is not None]
    verdict = RerunVerdict(
        checkpoint=os.path.basename(os.path.normpath(checkpoint_path)),
        iteration=int(machine.iteration),
        diagnosis=diagnosis,
        suspects=suspects if diagnosis == RerunDiagnostic.PERSISTENT_ERROR.value else [],
        message=next((m for d, _, m in gathered if d == diagnosis), ""),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    if write:
        _write(os.path.dirname(os.path.normpath(checkpoint_path)), verdict)
    return verdict


def _write(root: str, verdict: RerunVerdict) -> None:
    path = os.path.join(root, VERDICT_FILENAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(verdict), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # the diagnosis is logged anyway; the exit must go on
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        logger.error("cannot write the rerun verdict %s: %s", path, exc.strerror or exc)
        return
    where = ", ".join(f"{n}/{d}" for n, d in verdict.suspects) or "no device"
    logger.warning(
        "rerun verdict %s for %s (suspect: %s) written to %s: a launch on other hardware "
        "trains on from this checkpoint; the suspect device is refused",
        verdict.diagnosis, verdict.checkpoint, where, path,
    )  # fmt: skip


def read_verdict(root: str) -> tuple[RerunVerdict | None, str]:
    """``(verdict, "")``, or ``(None, why)`` when the file is absent or malformed."""
    path = os.path.join(root, VERDICT_FILENAME)
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{path} unreadable ({type(exc).__name__})"
    try:
        suspects = [(s[0], s[1]) for s in raw["suspects"]]
        verdict = RerunVerdict(raw["checkpoint"], raw["iteration"], raw["diagnosis"],
                               suspects, str(raw.get("message", "")), str(raw.get("time", "")))  # fmt: skip
    except (TypeError, KeyError, IndexError):
        return None, f"{path} is not a rerun verdict"
    valid = (
        isinstance(verdict.checkpoint, str)
        and isinstance(verdict.iteration, int)
        and verdict.diagnosis in _DIAGNOSES
        and all(isinstance(n, str) and isinstance(d, str) for n, d in verdict.suspects)
    )
    return (verdict, "") if valid else (None, f"{path} is not a rerun verdict")


def apply_verdict(machine: Any, checkpoint_path: str) -> RerunVerdict | None:
    """After loading ``checkpoint_path``: act on its verdict (see module docstring). Collective
    whenever the loaded state awaits the rerun from this checkpoint; returns the verdict applied.

    Raises:
        SuspectDeviceError: some rank runs on a suspect device (raised on every rank).
    """
    if machine.state is not RerunState.WILL_RERUN_FROM_CHECKPOINT:
        return None
    root = os.path.dirname(os.path.normpath(checkpoint_path))
    verdict, problem = read_verdict(root)
    if problem:
        logger.warning("%s; rerunning the iteration as the checkpoint asks", problem)
    applies = (
        verdict is not None
        and verdict.checkpoint == os.path.basename(os.path.normpath(checkpoint_path))
        and verdict.iteration == machine.iteration
    )
    here = device_identity()
    suspect = applies and verdict is not None and here in verdict.suspects
    not_applying, any_suspect = collectives.all_reduce_any(
        [not applies, suspect], machine.process_group
    )
    if not_applying or verdict is None:
        return None
    if any_suspect:
        who = f"this rank's device {here[0]}/{here[1]}" if suspect else "another rank's device"
        raise SuspectDeviceError(
            f"rerun verdict {os.path.join(root, VERDICT_FILENAME)}: {who} produced the "
            f"persistent error at iteration {verdict.iteration + 1}; resume "
            f"{checkpoint_path} on other hardware"
        )
    machine.forget_rerun_from_checkpoint()
    if machine.rank == 0:
        logger.warning(
            "rerun verdict %s for iteration %d (%s): this launch does not run on a suspect "
            "device; training on from %s",
            verdict.diagnosis, verdict.iteration + 1, verdict.message, checkpoint_path,
        )  # fmt: skip
    return verdict
