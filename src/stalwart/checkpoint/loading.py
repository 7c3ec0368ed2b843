"""Which checkpoint to load (pure filesystem decisions, run on rank 0 and then broadcast) and
the two-phase load of the chosen one that every rank agrees on."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import dcp_io, layout
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.integrity import check_checkpoint, read_state_dict, saved_world_size
from stalwart.distributed import collectives

logger = logging.getLogger("stalwart.checkpoint")


@dataclass(frozen=True)
class Choice:
    """A checkpoint directory chosen for loading."""

    iteration: int
    path: str
    non_persistent: bool


class CheckpointLocator:
    """Finds the checkpoint to resume from among a persistent and a non-persistent root.

    The trackers are authoritative: the newest tracked iteration across both roots wins (a tie
    prefers the persistent one). A complete directory newer than its tracker (crash between
    rename and tracker update) is ignored; with ``fallback`` older complete directories are
    candidates when the tracked one is unusable. Each candidate goes through
    `stalwart.checkpoint.integrity.check_checkpoint` (the check ``stalwart checkpoints
    --verify`` runs), with its checksums when ``verify_checksums``
    (``--verify-checkpoint-on-load``).
    """

    def __init__(
        self,
        load_dir: str | None,
        np_dir: str | None,
        fallback: bool,
        verify_checksums: bool = False,
    ) -> None:
        self._roots = [(r, np) for r, np in ((load_dir, False), (np_dir, True)) if r is not None]
        self._fallback = fallback
        self._verify = verify_checksums

    def _problem(self, path: str, log: logging.Logger) -> str | None:
        result = check_checkpoint(path, checksums=self._verify)
        if result.note is not None:
            log.warning("checkpoint %s: %s", path, result.note)
        return result.problem

    def latest_tracked(self) -> int | None:
        """Newest tracked iteration whose directory is complete; None if there is none. A
        damaged tracker counts as its root's newest complete checkpoint with ``fallback`` (what
        `choose` falls back to), else raises as `choose` does.

        Raises:
            CheckpointError: a damaged tracker without ``fallback``.
        """
        best = None
        for root, _ in self._roots:
            try:
                tracked = layout.read_tracker(root)
            except CheckpointError as exc:
                if not self._fallback:
                    raise CheckpointError(f"{exc}{diagnosis_hint(root, fallback=True)}") from None
                tracked = max(layout.list_complete_checkpoints(root), default=None)
            if tracked is None:
                continue
            if layout.is_complete(os.path.join(root, layout.iteration_dir_name(tracked))):
                best = tracked if best is None else max(best, tracked)
        return best

    def choose(
        self, iteration: int | None, rejected: set[str], log: logging.Logger
    ) -> Choice | None:
        """The checkpoint to load, None for a fresh start.

        Raises:
            CheckpointError: naming the path and the problem when nothing usable is found.
        """
        if iteration is not None:
            return self._explicit(iteration, log)
        heads, garbage = self._heads(log)
        if not heads and not garbage:
            found = [it for root, _ in self._roots for it in layout.list_complete_checkpoints(root)]
            if found:
                log.warning(
                    "complete checkpoints %s exist but no %s: starting from scratch",
                    found,
                    layout.TRACKER_FILENAME,
                )
            return None
        ordered = heads[:1]
        if self._fallback:
            limit = heads[0].iteration if heads else None
            ordered += self._older(limit)
        return self._first_usable(ordered, rejected, log)

    def _explicit(self, iteration: int, log: logging.Logger) -> Choice:
        for root, non_persistent in self._roots:
            path = os.path.join(root, layout.iteration_dir_name(iteration))
            if os.path.isdir(path):
                problem = self._problem(path, log)
                if problem is not None:
                    hint = diagnosis_hint(root, fallback=False)  # an explicit one never falls back
                    raise CheckpointError(f"checkpoint {path} is unusable: {problem}{hint}")
                return Choice(iteration, path, non_persistent)
        dirs = ", ".join(root for root, _ in self._roots)
        name = layout.iteration_dir_name(iteration)
        raise CheckpointError(f"no checkpoint directory {name} in {dirs or '(no --load)'}")

    def _heads(self, log: logging.Logger) -> tuple[list[Choice], bool]:
        """Tracked checkpoints, newest first; flag set when a tracker was garbage (fallback
        only)."""
        heads: list[Choice] = []
        garbage = False
        for root, non_persistent in self._roots:
            try:
                tracked = layout.read_tracker(root)
            except CheckpointError as exc:
                if not self._fallback:
                    raise CheckpointError(f"{exc}{diagnosis_hint(root, fallback=True)}") from None
                log.warning(
                    "%s; falling back to the newest complete checkpoint (--ckpt-fallback)",
                    exc,
                )
                garbage = True
                continue
            if tracked is not None:
                path = os.path.join(root, layout.iteration_dir_name(tracked))
                heads.append(Choice(tracked, path, non_persistent))
        heads.sort(key=lambda c: (c.iteration, not c.non_persistent), reverse=True)
        return heads, garbage

    def _older(self, limit: int | None) -> list[Choice]:
        """Every complete checkpoint at or below ``limit`` in both roots, newest first."""
        found = [
            Choice(it, os.path.join(root, layout.iteration_dir_name(it)), non_persistent)
            for root, non_persistent in self._roots
            for it in layout.list_complete_checkpoints(root)
            if limit is None or it <= limit
        ]
        found.sort(key=lambda c: (c.iteration, not c.non_persistent), reverse=True)
        return found

    def _first_usable(
        self, ordered: list[Choice], rejected: set[str], log: logging.Logger
    ) -> Choice:
        seen: set[str] = set()
        for choice in ordered:
            if choice.path in seen or choice.path in rejected:
                continue
            seen.add(choice.path)
            problem = self._problem(choice.path, log)
            if problem is None:
                return choice
            message = f"checkpoint {choice.path} is unusable: {problem}"
            if not self._fallback:
                raise CheckpointError(
                    message + diagnosis_hint(_root_of(choice.path), fallback=True)
                )
            log.warning("%s; trying an older one (--ckpt-fallback)", message)
        roots = ", ".join(root for root, _ in self._roots)
        raise CheckpointError(
            f"no usable checkpoint found in {roots}"
            + (f" (rejected: {sorted(rejected)})" if rejected else "")
            + diagnosis_hint(self._roots[0][0], fallback=False)
        )


def _root_of(path: str) -> str:
    return os.path.dirname(os.path.normpath(path)) or "."


def diagnosis_hint(root: str, *, fallback: bool) -> str:
    """What to run about a damaged checkpoint under ``root``, appended to its one-line error:
    the command that names the damage, and ``--ckpt-fallback`` where it applies (a resume from
    the newest checkpoint; never an explicit iteration, e.g. ``stalwart export --iteration``)."""
    hint = f"; `stalwart checkpoints --verify {root}` names what is damaged"
    if fallback:
        hint += ", --ckpt-fallback resumes from the newest usable checkpoint"
    return hint


def load_failure(choice: Choice, problem: str | None, *, explicit: bool) -> CheckpointError:
    """The error of a chosen checkpoint that did not load, with `diagnosis_hint` when it is
    damaged (a checkpoint of an older stalwart's pickle format says how to convert it instead)."""
    message = problem or f"loading {choice.path} failed"
    if layout.is_legacy(choice.path):
        return CheckpointError(message)
    return CheckpointError(message + diagnosis_hint(_root_of(choice.path), fallback=not explicit))


def nothing_to_load(load_dir: str | None, explicit: bool, log: logging.Logger) -> None:
    """No tracker anywhere: fine for ``--load`` = ``--save`` (a fresh run, logged), refused for a
    ``--load`` elsewhere (a typo or the wrong directory must not train from scratch).

    Raises:
        CheckpointError: naming ``--load`` and what is there instead.
    """
    if not explicit:
        log.info("no checkpoint in %s, starting from scratch", load_dir)
        return
    if load_dir is None or not os.path.exists(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: not a directory")
    found = layout.list_complete_checkpoints(load_dir)
    if found:
        raise CheckpointError(
            f"--load {load_dir}: complete checkpoints {found} but no {layout.TRACKER_FILENAME}; "
            "write the iteration to resume into that file"
        )
    if layout.parse_iteration_dir_name(os.path.basename(os.path.normpath(load_dir))) is not None:
        raise CheckpointError(
            f"--load {load_dir} is one checkpoint: pass the directory that holds it and its "
            f"{layout.TRACKER_FILENAME} ({os.path.dirname(os.path.normpath(load_dir))})"
        )
    raise CheckpointError(
        f"--load {load_dir}: no checkpoint there (no {layout.TRACKER_FILENAME}, no iter_* "
        "directory); to start from scratch leave --load unset"
    )


def read_small_files(
    path: str, rank: int, world_size: int, log: logging.Logger
) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """(common, this rank's per-rank dict or None, saved world size) of a checkpoint directory.

    All JSON (`safe_state`): nothing read here can run code. When the world size changed, rank
    r gets the file of saved rank r if it exists, else None, with a warning: the caller decides
    how to rebuild RNG/data-iterator state.

    Raises:
        CheckpointError: the checkpoint is in the pickle format of an older stalwart.
        StateFormatError, OSError: a file is missing or malformed.
    """
    if layout.is_legacy(path):
        raise CheckpointError(layout.convert_hint(path))
    saved_world = saved_world_size(path)
    common = read_state_dict(os.path.join(path, layout.COMMON_FILENAME))
    rank_file = os.path.join(path, layout.rank_filename(rank))
    if saved_world != world_size:
        log.warning(
            "checkpoint %s was saved by %d ranks, loading with %d: per-rank state %s",
            path,
            saved_world,
            world_size,
            "taken from the same rank's file" if os.path.exists(rank_file) else "is None",
        )
        if not os.path.exists(rank_file):
            return common, None, saved_world
    return common, read_state_dict(rank_file), saved_world


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load` restored besides model/optimizer tensors.

    Attributes:
        iteration: the checkpoint's iteration (all ranks agree).
        path: the checkpoint directory.
        common: the ``common`` dict given to ``save`` (identical on all ranks).
        per_rank: this rank's ``per_rank`` dict; None when the world size changed and no file
            exists for this rank (the caller decides how to re-derive RNG/data state).
        saved_world_size: the world size at save time.
        non_persistent: True when it came from the non-persistent directory, a local copy or
            an in-memory snapshot.
        source: for a local copy or an in-memory snapshot, which one ("the local copy of
            iteration 40"; ``path`` then names the iteration under ``--load``, where its rerun
            verdict would be); None for a directory.
    """

    iteration: int
    path: str
    common: dict[str, Any]
    per_rank: dict[str, Any] | None
    saved_world_size: int
    non_persistent: bool = False
    source: str | None = None


def try_load(
    choice: Choice,
    model: nn.Module,
    optimizer: Optimizer | None,
    *,
    strict: bool,
    check_common: Callable[[dict[str, Any]], None] | None,
    rank: int,
    world_size: int,
    group: Any,
) -> tuple[str | None, LoadedCheckpoint | None]:
    """Load ``choice`` in two phases every rank agrees on (small files, then DCP tensors).

    Collective over ``group``. Returns ``(problem, None)`` when any rank failed (the caller may
    fall back to an older checkpoint), else ``(None, loaded)``. ``check_common`` runs between the
    phases; its ``ValueError`` propagates (see `CheckpointManager.load`).
    """
    problem = None
    small: tuple[dict[str, Any], dict[str, Any] | None, int] | None = None
    try:
        small = read_small_files(choice.path, rank, world_size, logger)
    except CheckpointError as exc:
        problem = str(exc)
    except Exception as exc:
        problem = f"checkpoint {choice.path} is unreadable on rank {rank}: {exc}"
    if collectives.all_reduce_any([problem is not None], group)[0] or small is None:
        return problem or f"checkpoint {choice.path} is unreadable on another rank", None
    if check_common is not None:
        check_common(small[0])  # same file on every rank: every rank raises alike
    try:
        state = dcp_io.gather_state(model, optimizer)
        dcp_io.load_into(state, choice.path, group, strict)  # prunes optimizer state never saved
        dcp_io.apply_state(model, optimizer, state, strict)
    except Exception as exc:
        problem = f"checkpoint {choice.path}: loading model/optimizer failed: {exc}"
    if collectives.all_reduce_any([problem is not None], group)[0]:
        return problem or f"checkpoint {choice.path} failed to load on another rank", None
    common, per_rank, saved_world = small
    loaded = LoadedCheckpoint(
        choice.iteration, choice.path, common, per_rank, saved_world, choice.non_persistent
    )
    return None, loaded
