"""The path forward after a diagnosis: ``<save>/rerun_verdict.json``, the launcher's record of
the suspect devices.

Megatron's protocol ends a persistent error with exit 17 and leaves the checkpoint marked "rerun
this iteration from here on another GPU": every later launch resumes it, reruns the iteration
and exits 17 again, so the operator has no way to continue on good hardware. Here every finished
attribution is recorded next to the checkpoint tracker (``stalwart.reliability.exit.leave``
writes it, rank 0), whichever flow reached it::

    {"checkpoint": "iter_0000003", "iteration": 3, "diagnosis": "persistent_error",
     "suspects": [["node7", "3"]], "suspect_ranks": [5], "source": "peer_replay",
     "message": "...", "time": "2026-...Z"}

* ``source``: ``peer_replay`` (diagnosed in the launch that met the fault, on a peer replica),
  ``rerun_from_checkpoint`` (Megatron's: after an exit 16 and a relaunch elsewhere),
  ``replica_check`` (replica fingerprints: a majority vote, or a copy that changed in a rerun)
  or ``transient_budget`` (``--rerun-transient-policy continue``: a device had more transient
  errors than ``--rerun-transient-budget``);
* ``diagnosis``: ``persistent_error``, ``correct_result``, ``replica_corruption`` or
  ``repeated_transient_errors``;
* ``iteration`` counts completed iterations (the failed iteration is logged as ``iteration +
  1``); ``checkpoint`` is the checkpoint to resume (saved at ``iteration`` when the diagnosis
  saved one, else the latest complete one), by its name in the save directory in the layout of
  whoever saved it: the reference trainer's ``iter_0000003``, the Lightning callback's
  ``iter_0000003.ckpt``, the Hugging Face Trainer's ``checkpoint-4`` (the adapters tell the
  shell which checkpoint they saved or loaded, ``Shell.checkpoint_at``);
* ``suspects`` are the (node, device) identities to exclude, ``suspect_ranks`` their ranks in
  the launch that found them.

A later launch that resumes a checkpoint of that save directory (:func:`apply_verdict`, called
after loading; ``Checkpointer.load`` does it for a registered machine):

* any rank on a suspect device (``STALWART_DEVICE_ID`` simulates devices), while the resumed
  checkpoint is not past ``iteration``: refused before training with one line and exit code 16
  (``SuspectDeviceError``: schedule it elsewhere);
* elsewhere: a checkpoint marked for the rerun of the diagnosed iteration drops the mark and
  trains on from the checkpoint, past the failed iteration;
* after a ``correct_result`` diagnosis (the value was reproduced on another device, so the
  hardware is fine and the run itself produces it): trains on as well; if the same check fails
  again, the machine diagnoses it afresh (skip it with ``--iterations-to-skip``).

The file is plain JSON checked field by field (reading it runs nothing); an unreadable or
unrelated file changes nothing (the old behaviour: the rerun from the checkpoint).

Example (``leave`` writes the file; a hand-written loop that loads without ``Checkpointer``)::

    loaded = manager.load(model, optimizer)
    apply_verdict(machine, loaded.path)      # collective; raises SuspectDeviceError (exit 16)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.distributed import collectives
from stalwart.iteration_dirs import iteration_dir_name, parse_iteration_dir_name, tracker_iteration
from stalwart.reliability.rerun.types import (
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Diagnosis,
    Identity,
    RerunState,
    device_identity,
)

logger = logging.getLogger(__name__)

VERDICT_FILENAME = "rerun_verdict.json"
SUSPECTS_FILENAME = "suspect_devices.json"
# Diagnoses that name bad devices, then the one that does not.
_EXCLUDING = ("persistent_error", "replica_corruption", "repeated_transient_errors")
_DIAGNOSES = (*_EXCLUDING, "correct_result")
_SOURCES = ("peer_replay", "rerun_from_checkpoint", "replica_check", "transient_budget")


class SuspectDeviceError(ValueError):
    """This launch runs on a device that a rerun verdict names as faulty; the CLI exits 16."""

    exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE


@dataclass(frozen=True)
class VerdictFile:
    """The content of ``rerun_verdict.json`` (see module docstring)."""

    checkpoint: str | None
    iteration: int
    diagnosis: str
    suspects: list[Identity]
    message: str
    time: str
    source: str = "rerun_from_checkpoint"
    suspect_ranks: list[int] = field(default_factory=list)


def verdict_of(diagnosis: Diagnosis, checkpoint: str | None) -> VerdictFile:
    """The file's content for ``diagnosis`` (``checkpoint``: the name of the one to resume)."""
    return VerdictFile(
        checkpoint=checkpoint,
        iteration=int(diagnosis.iteration),
        diagnosis=diagnosis.diagnosis,
        suspects=[s.identity for s in diagnosis.suspects],
        message=diagnosis.message,
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source=diagnosis.source.value,
        suspect_ranks=[s.rank for s in diagnosis.suspects],
    )


def write_verdict(root: str, diagnosis: Diagnosis, *, checkpoint: str | None = None) -> str | None:
    """Write ``<root>/rerun_verdict.json`` and, when the diagnosis names suspects,
    ``<root>/suspect_devices.json`` (:func:`suspect_devices`) atomically (rank 0 only); the
    verdict's path, or None when it could not be written (logged: the exit must go on).

    ``checkpoint``: the name (in ``root``) of the checkpoint to train on from, in the layout of
    whoever saved it (a framework adapter's ``iter_0000005.ckpt`` or ``checkpoint-6``); None:
    the reference trainer's ``iter_NNNNNNN`` of the diagnosis (or its tracker's latest)."""
    if checkpoint is None:
        resumed = diagnosis.checkpoint_iteration
        if resumed is None:
            with contextlib.suppress(Exception):  # an unreadable tracker: no checkpoint named
                resumed = tracker_iteration(root)
        checkpoint = iteration_dir_name(resumed) if resumed is not None else None
    verdict = verdict_of(diagnosis, checkpoint)
    path = os.path.join(root, VERDICT_FILENAME)
    if not _write_json(path, asdict(verdict)):
        return None
    suspects_path = os.path.join(root, SUSPECTS_FILENAME)
    if verdict.suspects:
        _write_json(suspects_path, suspect_devices(diagnosis, checkpoint))
    else:  # a later diagnosis without suspects: an older list no longer describes this run
        with contextlib.suppress(OSError):
            os.unlink(suspects_path)
    where = ", ".join(f"{n}/{d}" for n, d in verdict.suspects) or "no device"
    logger.warning(
        "rerun verdict %s (%s) for iteration %d (suspect: %s) written to %s: a launch on other "
        "hardware trains on from %s; the suspect devices are refused",
        verdict.diagnosis,
        verdict.source,
        verdict.iteration + 1,
        where,
        path,
        checkpoint or "the latest checkpoint",
    )
    return path


def suspect_devices(diagnosis: Diagnosis, checkpoint: str | None) -> dict[str, Any]:
    """The launcher's record of the devices to exclude (``<save>/suspect_devices.json``)::

        {"iteration": 3, "diagnosis": "persistent_error", "source": "peer_replay",
         "checkpoint": "iter_0000003",
         "suspects": [{"rank": 1, "host": "node7", "device": "3"}]}

    A scheduler reads it to place the relaunch elsewhere (it is written only when a diagnosis
    names suspects; the launch itself enforces the exclusion from ``rerun_verdict.json``)."""
    return {
        "iteration": int(diagnosis.iteration),
        "diagnosis": diagnosis.diagnosis,
        "source": diagnosis.source.value,
        "checkpoint": checkpoint,
        "suspects": [
            {"rank": s.rank, "host": s.node, "device": s.device} for s in diagnosis.suspects
        ],
    }


def _write_json(path: str, content: dict[str, Any]) -> bool:
    """Atomic write (fsync, rename); False (logged) when it failed: the exit goes on."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomic(path, json.dumps(content, indent=2), sync=Sync.FILE)
    except OSError as exc:
        logger.error("cannot write %s: %s", path, exc.strerror or exc)
        return False
    return True


def read_verdict(root: str) -> tuple[VerdictFile | None, str]:
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
        verdict = VerdictFile(
            raw["checkpoint"],
            raw["iteration"],
            raw["diagnosis"],
            [(s[0], s[1]) for s in raw["suspects"]],
            str(raw.get("message", "")),
            str(raw.get("time", "")),
            raw.get("source", "rerun_from_checkpoint"),
            list(raw.get("suspect_ranks", [])),
        )
    except (TypeError, KeyError, IndexError):
        return None, f"{path} is not a rerun verdict"
    return (verdict, "") if _valid(verdict) else (None, f"{path} is not a rerun verdict")


def _valid(v: VerdictFile) -> bool:
    return (
        (v.checkpoint is None or isinstance(v.checkpoint, str))
        and isinstance(v.iteration, int)
        and not isinstance(v.iteration, bool)
        and v.diagnosis in _DIAGNOSES
        and v.source in _SOURCES
        and all(isinstance(n, str) and isinstance(d, str) for n, d in v.suspects)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in v.suspect_ranks)
    )


def _loaded_iteration(checkpoint_path: str) -> int | None:
    return parse_iteration_dir_name(os.path.basename(os.path.normpath(checkpoint_path)))


def apply_verdict(
    machine: Any, checkpoint_path: str, *, iteration: int | None = None, root: str | None = None
) -> VerdictFile | None:
    """After loading ``checkpoint_path``: act on the verdict of its save directory (see module
    docstring). Collective (one all-reduce; every rank calls it after the same load); returns
    the verdict applied. ``iteration``: the loaded checkpoint's completed iterations (default:
    parsed from an ``iter_NNNNNNN`` name; give it for any other layout); ``root``: the
    directory holding the verdict (default: the checkpoint's).

    Raises:
        SuspectDeviceError: some rank runs on a suspect device (raised on every rank).
    """
    root = root or os.path.dirname(os.path.normpath(checkpoint_path))
    verdict, problem = read_verdict(root)
    marked = machine.state is RerunState.WILL_RERUN_FROM_CHECKPOINT
    if problem and marked:
        logger.warning("%s; rerunning the iteration as the checkpoint asks", problem)
    name = os.path.basename(os.path.normpath(checkpoint_path))
    loaded = _loaded_iteration(checkpoint_path) if iteration is None else iteration
    settles = (  # the verdict is about the iteration this checkpoint reruns
        marked
        and verdict is not None
        and verdict.checkpoint == name
        and verdict.iteration == machine.iteration
    )
    excludes = (  # the run has not got past the iteration that found the suspects
        verdict is not None
        and verdict.diagnosis in _EXCLUDING
        and (settles or (loaded is not None and loaded <= verdict.iteration))
    )
    here = device_identity()
    suspect = bool(excludes and verdict is not None and here in verdict.suspects)
    unsettled, any_suspect, any_excludes = collectives.all_reduce_any(
        [marked and not settles, suspect, excludes], machine.process_group
    )
    if verdict is None or (unsettled and not any_excludes):
        return None
    if any_suspect:
        who = f"this rank's device {here[0]}/{here[1]}" if suspect else "another rank's device"
        raise SuspectDeviceError(
            f"rerun verdict {os.path.join(root, VERDICT_FILENAME)}: {who} produced the "
            f"{verdict.diagnosis.replace('_', ' ')} at iteration {verdict.iteration + 1}; resume "
            f"{checkpoint_path} on other hardware"
        )
    if unsettled:
        return None  # a mark the verdict is not about: the rerun from the checkpoint
    if settles or any_excludes:
        if marked:
            machine.forget_rerun_from_checkpoint()
        if machine.reporter.rank == 0:
            logger.warning(
                "rerun verdict %s for iteration %d (%s): this launch does not run on a suspect "
                "device; training on from %s",
                verdict.diagnosis,
                verdict.iteration + 1,
                verdict.message,
                checkpoint_path,
            )
        return verdict
    return None
