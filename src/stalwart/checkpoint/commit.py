"""The steps of one save, each agreed across ranks: create the tmp directory, write the small
files, publish (marker → rename → tracker → retention) or discard.

`CheckpointManager` decides *when* (synchronously, or when an async write has finished on every
rank); `SaveSteps` does each step the same way in both modes. Rank 0 acts on the directory, under
the save-directory lock; every other rank learns the outcome in one collective.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from stalwart.atomic_file import fsync_dir, write_text_atomic
from stalwart.checkpoint import integrity, layout
from stalwart.checkpoint.errors import CheckpointError, PeerLostError
from stalwart.checkpoint.lock import SaveDirLocks
from stalwart.distributed import collectives
from stalwart.log_notice import NOTICE

FORMAT_VERSION = "stalwart-dcp-v2"  # v1: common.pt/rank_*.pt pickles (convert --trust-pickle)


@dataclass
class PendingSave:
    """A save whose shards are (being) written into ``tmp_path`` and not yet published."""

    iteration: int
    root: str
    tmp_path: str
    non_persistent: bool
    future: concurrent.futures.Future | None
    started: float
    facts: dict[str, Any] | None = None  # metadata.json's, repeated in the marker


@dataclass(frozen=True)
class SaveSteps:
    """The collective steps of a save (see module docstring).

    Args:
        rank, world_size, src, group: this rank in the checkpoint's group, as
            `stalwart.checkpoint.dcp_io.group_rank_info` gives them.
        locks: the save directories' locks; rank 0 must hold them to delete or publish.
        keep_last: ``--ckpt-keep-last`` for persistent saves (None: keep all).
        async_save: recorded in each checkpoint's metadata; the async writer then writes the
            checksum manifest on its background thread (rank 0), else the commit does.
        checksums: write the checksum manifest (`stalwart.checkpoint.integrity`).
        before_commit: called with the iteration on rank 0 inside the commit window.
        logger: where the steps log.
    """

    rank: int
    world_size: int
    src: int
    group: Any
    locks: SaveDirLocks
    keep_last: int | None
    async_save: bool
    checksums: bool
    before_commit: Callable[[int], None] | None
    logger: logging.Logger

    def begin(self, root: str, iteration: int, flag: str, own_root: bool) -> str:
        """Rank 0 removes stale tmp dirs and creates this save's tmp dir; all ranks get its path.
        ``flag`` names ``root``; ``own_root``: stalwart creates ``root``
        (``<save>/non_persistent``)."""
        decision: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            try:
                decision = (self._create_tmp_dir(root, iteration, flag, own_root), None)
            except CheckpointError as exc:
                decision = (None, str(exc))
            except OSError as exc:
                decision = (None, f"cannot create checkpoint directory under {root}: {exc}")
        path, error = cast(
            "tuple[str | None, str | None]",
            collectives.broadcast_object(decision, self.src, self.group),
        )
        if error is not None or path is None:
            raise CheckpointError(error or "checkpoint directory was not created")
        return str(path)

    def _create_tmp_dir(self, root: str, iteration: int, flag: str, own_root: bool) -> str:
        refused = self.locks.acquire() or layout.link_problem(root, flag, own_root)
        if refused is not None:
            raise CheckpointError(refused)
        self.locks.check_held()  # leftovers are deleted only while this job holds it
        os.makedirs(root, exist_ok=True)
        for stale in layout.list_tmp_dirs(root):
            self.logger.info("removing leftover partial checkpoint %s", stale)
            layout.remove_checkpoint_dir(stale, self.logger)
        # Random suffix: after an in-process restart the same process may save the same
        # iteration within a second while the aborted attempt's writer still runs.
        token = f"{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
        created = os.path.join(root, layout.tmp_dir_name(iteration, token))
        os.makedirs(created)
        return created

    def write_small_files(
        self,
        tmp: str,
        iteration: int,
        common: dict[str, Any],
        per_rank: dict[str, Any],
        non_persistent: bool,
    ) -> dict[str, Any]:
        """Write common.json + metadata.json (rank 0) and this rank's file; agree on success.
        Returns the facts of metadata.json (rank 0's are the ones written)."""
        problem = None
        facts = self.facts(iteration, non_persistent)
        try:
            os.makedirs(tmp, exist_ok=True)
            if self.rank == 0:
                layout.write_state_fsynced(common, os.path.join(tmp, layout.COMMON_FILENAME))
                write_text_atomic(
                    os.path.join(tmp, layout.METADATA_FILENAME), json.dumps(facts, indent=2) + "\n"
                )
            layout.write_state_fsynced(per_rank, os.path.join(tmp, layout.rank_filename(self.rank)))
        except Exception as exc:  # report any failure (an unstorable value included) to every rank
            problem = f"rank {self.rank} could not write into {tmp}: {exc}"
        if collectives.all_reduce_any([problem is not None], self.group)[0]:
            self.discard(PendingSave(iteration, "", tmp, non_persistent, None, 0.0))
            raise CheckpointError(problem or f"another rank failed writing into {tmp}")
        return facts

    def facts(self, iteration: int, non_persistent: bool) -> dict[str, Any]:
        """The checkpoint's ``metadata.json`` (and ``COMPLETE`` marker) contents."""
        return {
            "format": FORMAT_VERSION,
            "iteration": iteration,
            "world_size": self.world_size,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch_version": torch.__version__,
            "non_persistent": non_persistent,
            "async_save": self.async_save,
        }

    def commit(self, pending: PendingSave) -> None:
        """Rank 0 publishes the checkpoint; every rank learns the outcome (one broadcast)."""
        error = None
        if self.rank == 0:
            try:
                self._publish(pending)
            except Exception as exc:
                error = f"committing checkpoint {pending.tmp_path} failed: {exc}"
        with self.peer_loss(pending, "commit"):
            outcome = collectives.broadcast_object(error, self.src, self.group)
        if outcome is not None:
            raise CheckpointError(str(outcome))
        if self.rank == 0:
            kind = "non-persistent checkpoint" if pending.non_persistent else "checkpoint"
            self.logger.info(
                "saved %s iteration %d to %s in %.2fs",
                kind,
                pending.iteration,
                os.path.join(pending.root, layout.iteration_dir_name(pending.iteration)),
                time.monotonic() - pending.started,
                extra=NOTICE,
            )

    def _publish(self, pending: PendingSave) -> None:
        """Manifest (sync saves) → marker → rename → tracker → retention. Only rank 0 runs
        this, under the lock."""
        if self.before_commit is not None:
            self.before_commit(pending.iteration)
        self.locks.check_held()
        root, iteration = pending.root, pending.iteration
        if self.checksums and not self.async_save:
            integrity.write_manifest(pending.tmp_path)
        facts = pending.facts or self.facts(iteration, pending.non_persistent)
        layout.write_marker(pending.tmp_path, facts, integrity.manifest_crc(pending.tmp_path))
        final = os.path.join(root, layout.iteration_dir_name(iteration))
        replaced = None
        if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): move old aside
            replaced = pending.tmp_path + "-replaced"
            os.replace(final, replaced)
        os.replace(pending.tmp_path, final)
        fsync_dir(root)
        layout.write_tracker_atomic(root, iteration)
        if replaced is not None:
            layout.remove_checkpoint_dir(replaced, self.logger)
        keep = 1 if pending.non_persistent else self.keep_last
        if keep is not None:
            layout.apply_retention(root, keep, pending.non_persistent, self.logger)

    @contextlib.contextmanager
    def peer_loss(self, pending: PendingSave, step: str) -> Iterator[None]:
        """Turn a collective that failed because a rank went away (gloo: "Connection closed by
        peer") into one `PeerLostError` line: which rank, and what is kept on disk."""
        try:
            yield
        except RuntimeError as exc:
            if self.world_size < 2 or isinstance(exc, CheckpointError):
                raise
            raise PeerLostError(self._peer_lost(pending, step, exc)) from exc

    def _peer_lost(self, pending: PendingSave, step: str, exc: BaseException) -> str:
        who = f"rank {1 - self.rank}" if self.world_size == 2 else "a peer rank"
        cause = re.sub(
            r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        )
        cause = cause.split(". ")[0] or type(exc).__name__
        kind = "non-persistent checkpoint" if pending.non_persistent else "checkpoint"
        try:
            kept = layout.read_tracker(pending.root)
        except CheckpointError:
            kept = None
        if kept == pending.iteration:
            saved = f"the {kind} of iteration {kept} was committed before"
        elif kept is not None:
            saved = f"the last committed {kind}, iteration {kept}, is kept"
        else:
            saved = "no checkpoint had been committed there yet"
        return (
            f"{who} went away during the {step} of {kind} iteration {pending.iteration} "
            f"({cause}); {saved} in {pending.root} (its {layout.TRACKER_FILENAME}); "
            "relaunch the job to resume from it"
        )

    def discard(self, pending: PendingSave) -> None:
        """Rank 0 removes a save that will never be published."""
        if self.rank == 0:
            layout.remove_checkpoint_dir(pending.tmp_path, self.logger)
