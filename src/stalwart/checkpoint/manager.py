"""CheckpointManager: crash-safe, Megatron-layout checkpoints for any hand-written training loop.

Typical loop (every rank calls every method; each is collective when a process group exists)::

    ckpt = CheckpointManager(args.save, args.load, keep_last=args.ckpt_keep_last,
                             async_save=args.async_save, fallback=args.ckpt_fallback,
                             non_persistent_dir=args.non_persistent_ckpt_dir)
    ckpt.check_writable()                         # before training: clear error for --save
    loaded = ckpt.load(model, optimizer, load_optim=not args.no_load_optim)
    for iteration in range(start, train_iters):
        ckpt.maybe_finalize()                     # top of step: commit a finished async save
        ...train step...
        if iteration % save_interval == 0:
            ckpt.save(iteration, model, optimizer, common, per_rank)
    ckpt.finalize()                               # before exit: blocking commit
    ckpt.close()

Save protocol: every rank writes into ``<root>/iter_N.tmp-<token>/`` (DCP shards, ``common.json``
from rank 0, ``rank_XXXXX.json`` from each rank); once all ranks agree that their part is written,
rank 0 writes the ``COMPLETE`` marker, renames the directory to ``iter_N`` and only then
atomically advances ``latest_checkpointed_iteration.txt``. A crash at any point leaves the tracker
on the previous complete checkpoint; leftover tmp directories are removed by the next save.
The steps themselves are `stalwart.checkpoint.commit.SaveSteps`; this class decides when.

One job per directory: rank 0 holds a `SaveDirLock` on ``--save`` (and on an explicit
``--non-persistent-ckpt-dir``) from ``check_writable`` (or the first save) to ``close``; leftover
partial saves are removed only under it. Retention deletes only complete checkpoints whose
marker says this kind of save (persistent / non-persistent) wrote them.

Nothing read from a checkpoint directory can run code: the small state is JSON
(`stalwart.checkpoint.safe_state`), DCP's pickled metadata and non-tensor entries go through an
allow-list unpickler (`stalwart.checkpoint.dcp_safe`).

``before_commit(iteration)`` runs on rank 0 inside every commit window (the fault injector's
``--inject-fault-phase commit``). ``copies`` take the non-persistent saves of the ``local`` and
``in_memory`` types instead of a directory (`stalwart.checkpoint.non_persistent`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import dcp_io, integrity, layout, resume
from stalwart.checkpoint.commit import PendingSave, SaveSteps
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.loading import (
    CheckpointLocator,
    Choice,
    LoadedCheckpoint,
    load_failure,
    try_load,
)
from stalwart.checkpoint.lock import SaveDirLocks
from stalwart.checkpoint.resume import CopyChoice, CopyTier
from stalwart.distributed import collectives
from stalwart.log_notice import NOTICE

logger = logging.getLogger("stalwart.checkpoint")


class CheckpointManager:
    """Saves and loads checkpoints in Megatron's directory layout (see module docstring).

    Args:
        save_dir: ``--save``; None disables saving.
        load_dir: ``--load``; defaults to ``save_dir``.
        keep_last: ``--ckpt-keep-last``: keep only the newest N persistent checkpoints.
        async_save: ``--async-save``: ``save`` blocks only for the host copy; the write finishes in
            the background and is committed by a later ``maybe_finalize``/``finalize``/``save``.
        fallback: ``--ckpt-fallback``: on an unusable newest checkpoint, warn and load the newest
            older complete one instead of raising.
        non_persistent_dir: ``--non-persistent-ckpt-dir``; defaults to ``<save>/non_persistent``.
            It must not be ``--save`` or inside it (other than that default), nor hold it.
        process_group: group the checkpoint spans (default: the world). With ``async_save`` and a
            process group, the constructor is collective (it creates a gloo group for DCP).
        before_commit: called with the iteration on rank 0 inside every commit window.
        job_id: this job's identity for the save-directory lock (default: from the launcher's
            environment, see `stalwart.checkpoint.lock`).
        verify_on_load: ``--verify-checkpoint-on-load``: ``load`` also checks every file of the
            chosen checkpoint against its checksum manifest (rank 0 reads it all once); a
            mismatch makes it unusable (``fallback`` then tries the previous one).
        checksums: write each checkpoint's checksum manifest (`stalwart.checkpoint.integrity`);
            False only to measure its cost (``bench/checkpoint_save.py``).
        copies: where non-persistent saves go instead of ``non_persistent_dir``
            (``--non-persistent-ckpt-type local`` / ``in_memory``: a
            `stalwart.checkpoint.local.LocalCheckpoints` or
            `stalwart.checkpoint.in_memory.InMemorySnapshots`); a resume then takes the newest
            complete iteration among the directories and these copies
            (`stalwart.checkpoint.resume`).

    Raises:
        ValueError: naming the flags, for ``keep_last < 1`` or overlapping directories.
    """

    def __init__(
        self,
        save_dir: str | None,
        load_dir: str | None = None,
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        fallback: bool = False,
        non_persistent_dir: str | None = None,
        process_group: Any = None,
        before_commit: Callable[[int], None] | None = None,
        job_id: str | None = None,
        verify_on_load: bool = False,
        checksums: bool = True,
        copies: CopyTier | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"--ckpt-keep-last must be an integer >= 1 (or unset), got {keep_last}"
            )
        layout.check_roots_disjoint(save_dir, non_persistent_dir)
        self._save_dir = save_dir
        self._load_dir = load_dir if load_dir is not None else save_dir
        # --load naming somewhere else must hold a checkpoint; --load = --save may be empty.
        self._load_explicit = load_dir is not None and (
            save_dir is None or os.path.realpath(load_dir) != os.path.realpath(save_dir)
        )
        self._np_dir_explicit = non_persistent_dir is not None
        self._np_dir = non_persistent_dir or (
            os.path.join(save_dir, layout.NON_PERSISTENT_SUBDIR) if save_dir else None
        )
        self._locks = SaveDirLocks(self._roots(), job_id)
        self._fallback = fallback
        self._verify_on_load = verify_on_load
        self._checksums = checksums
        self._group = process_group
        self._rank, self._world_size, self._src = dcp_io.group_rank_info(process_group)
        self._pending: PendingSave | None = None
        self._copies = copies
        if copies is not None:
            copies.bind(process_group)
        self._closed = False
        self._ckpt_group: Any = None
        self._async: dcp_io.AsyncWriter | None = None
        if async_save:
            self._ckpt_group = dcp_io.new_checkpoint_group(process_group)
            self._async = dcp_io.AsyncWriter(self._ckpt_group, logger)
        self._steps = SaveSteps(
            self._rank,
            self._world_size,
            self._src,
            process_group,
            self._locks,
            keep_last,
            async_save,
            checksums,
            before_commit,
            logger,
        )

    @property
    def copies(self) -> CopyTier | None:
        """The local or in-memory copies the non-persistent saves go to (None: a directory)."""
        return self._copies

    @property
    def async_save(self) -> bool:
        """Whether saves finish in the background (``--async-save``)."""
        return self._async is not None

    # ------------------------------------------------------------------ checks
    def check_writable(self) -> None:
        """Create the save directories, probe-write a file on every rank, then take the lock of
        each save directory on rank 0 (collective).

        Raises:
            ValueError: naming ``--save`` (or ``--non-persistent-ckpt-dir``) on every rank when any
                rank cannot write there, or when another job holds its lock.
        """
        problem = None
        for directory, flag in self._roots():
            if directory is not None and problem is None:
                problem = layout.probe_writable(directory, flag, self._rank)
        if problem is None and self._rank == 0:
            problem = self._link_problem()
        failed = collectives.all_reduce_any([problem is not None], self._group)[0]
        if failed:
            raise ValueError(
                problem or "a checkpoint directory (--save) is not writable on another rank"
            )
        refused = self._locks.acquire() if self._rank == 0 else None
        outcome = collectives.broadcast_object(refused, self._src, self._group)
        if outcome is not None:
            raise ValueError(str(outcome))
        if self._copies is not None:
            self._copies.check_writable()

    def _where(self, non_persistent: bool) -> tuple[str, bool]:
        """(the flag naming that root, whether stalwart creates the root itself: the default
        ``<save>/non_persistent``)."""
        own_root = non_persistent and not self._np_dir_explicit
        return (
            "--non-persistent-ckpt-dir" if non_persistent and not own_root else "--save"
        ), own_root

    def _link_problem(self) -> str | None:
        for root, non_persistent in ((self._save_dir, False), (self._np_dir, True)):
            problem = layout.link_problem(root, *self._where(non_persistent)) if root else None
            if problem is not None:
                return problem
        return None

    def _roots(self) -> list[tuple[str | None, str]]:
        roots = [(self._save_dir, "--save")]
        if self._np_dir_explicit:
            roots.append((self._np_dir, "--non-persistent-ckpt-dir"))
        return roots

    # -------------------------------------------------------------------- save
    def save(
        self,
        iteration: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        common: dict[str, Any],
        per_rank: dict[str, Any],
        *,
        non_persistent: bool = False,
    ) -> None:
        """Save a checkpoint of ``iteration`` (collective; all ranks pass the same ``common``).

        Synchronous mode returns after the checkpoint is committed and the tracker advanced.
        Async mode returns after staging; ``maybe_finalize``/``finalize`` commit it later. Any
        earlier async save is finalized (blocking) first.

        Raises:
            ValueError: saving is disabled (no ``--save``).
            CheckpointError: writing failed on some rank; nothing was committed.
        """
        if self._closed:
            raise CheckpointError("CheckpointManager.save() called after close()")
        if non_persistent and self._copies is not None:
            state = dcp_io.gather_state(model, optimizer, for_save=True)
            self._copies.save(iteration, state, common, per_rank)
            return
        root = self._np_dir if non_persistent else self._save_dir
        if root is None:
            flags = "--save or --non-persistent-ckpt-dir" if non_persistent else "--save"
            raise ValueError(f"checkpoint save requested but {flags} is not set")
        self._maybe_finalize_dir(blocking=True)
        started = time.monotonic()
        tmp = self._steps.begin(root, iteration, *self._where(non_persistent))
        facts = self._steps.write_small_files(tmp, iteration, common, per_rank, non_persistent)
        state = dcp_io.gather_state(model, optimizer, for_save=True)
        pending = PendingSave(iteration, root, tmp, non_persistent, None, started, facts)
        if self._async is None:
            try:
                dcp_io.save_sync(state, tmp, self._group)
            except Exception as exc:
                self._steps.discard(pending)
                raise CheckpointError(
                    layout.save_failure_message(
                        f"saving checkpoint into {tmp}", root, dcp_io.describe_failure(exc)
                    )
                ) from exc
            self._steps.commit(pending)
            return
        self._start_async(pending, state)

    def _start_async(self, pending: PendingSave, state: dict[str, Any]) -> None:
        assert self._async is not None
        # Rank 0 writes the manifest on the writer's background thread once DCP's write is
        # done: DCP writes .metadata only after every rank's shards are written.
        then = integrity.write_manifest if self._rank == 0 and self._checksums else None
        try:
            pending.future = self._async.start(state, pending.tmp_path, then=then)
        except Exception as exc:
            self._steps.discard(pending)
            raise CheckpointError(
                f"starting async checkpoint save into {pending.tmp_path} failed: "
                f"{dcp_io.describe_failure(exc)}"
            ) from exc
        self._pending = pending
        if self._rank == 0:
            logger.info(
                "async checkpoint save of iteration %d started into %s (blocked %.2fs for staging)",
                pending.iteration,
                pending.tmp_path,
                time.monotonic() - pending.started,
            )

    # ---------------------------------------------------------------- finalize
    def maybe_finalize(self, blocking: bool = False) -> int | None:
        """Commit the in-flight async save once it is written on every rank (collective).

        Non-blocking: one all-reduce of (not-done, failed) flags; returns None while any rank is
        still writing. Blocking: waits for this rank's write first. On success the checkpoint is
        renamed into place and the tracker advanced; returns its iteration. Without a pending save
        it returns None and issues no collective.

        A local or in-memory copy in flight is finalized the same way (see ``copies``); the
        iteration committed last is returned.

        Raises:
            CheckpointError: the background write failed on some rank (the partial save is removed).
        """
        committed = self._maybe_finalize_dir(blocking)
        copied = self._copies.maybe_finalize(blocking) if self._copies is not None else None
        return committed if copied is None else copied

    def _maybe_finalize_dir(self, blocking: bool) -> int | None:
        pending = self._pending
        if pending is None or pending.future is None:
            return None
        if blocking:
            concurrent.futures.wait([pending.future])
        done = pending.future.done()
        failed = done and pending.future.exception() is not None
        # Deliberate sync: only while a save is in flight; all ranks must agree before the commit.
        with self._steps.peer_loss(pending, "agreement on the write"):
            any_not_done, any_failed = collectives.all_reduce_any([not done, failed], self._group)
        if any_not_done and not any_failed:
            return None
        if any_failed:
            if not done:  # never commit or delete under a writer that is still running
                concurrent.futures.wait([pending.future])
            self._pending = None
            self._steps.discard(pending)
            cause = pending.future.exception() if failed else None
            summary = (
                dcp_io.describe_failure(cause) if cause is not None else "failed on another rank"
            )
            raise CheckpointError(
                layout.save_failure_message(
                    f"async checkpoint save into {pending.tmp_path}", pending.root, summary
                )
            ) from cause
        self._pending = None
        self._steps.commit(pending)
        return pending.iteration

    def finalize(self) -> None:
        """Blocking :meth:`maybe_finalize`: call before exit and before loading."""
        self.maybe_finalize(blocking=True)

    # -------------------------------------------------------------------- load
    def _locator(self) -> CheckpointLocator:
        return CheckpointLocator(
            self._load_dir, self._np_dir, self._fallback, verify_checksums=self._verify_on_load
        )

    def latest_iteration(self) -> int | None:
        """Newest complete checkpoint that a tracker points at (persistent or non-persistent).

        Local (no collective); None when neither directory holds a tracked complete checkpoint.
        """
        return self._locator().latest_tracked()

    def load(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        *,
        load_optim: bool = True,
        iteration: int | None = None,
        strict: bool = True,
        check_common: Callable[[dict[str, Any]], None] | None = None,
    ) -> LoadedCheckpoint | None:
        """Load the newest checkpoint (or ``iteration``) into ``model``/``optimizer`` in place.

        Rank 0 chooses the checkpoint and broadcasts it, so all ranks load the same iteration
        (with ``copies``: every rank makes the same choice, `stalwart.checkpoint.resume`).
        ``load_optim=False`` (``--no-load-optim``/``--finetune``) restores only the model.
        ``check_common(common)`` runs on the checkpoint's small ``common`` dict before any tensor
        is read; a ``ValueError`` from it (e.g. the model was saved with other shapes) propagates
        as is: the checkpoint is fine, the run does not match it, so no fallback applies.

        Returns:
            None when there is nothing to load (no tracker anywhere; logged as "no checkpoint in
            DIR, starting from scratch"), else the restored metadata.

        Raises:
            CheckpointError: naming the path and the problem, when the chosen checkpoint is
                missing/incomplete/corrupt (with ``fallback``, only when no older one works either;
                an explicit ``iteration`` never falls back), and when a ``load_dir`` other than
                ``save_dir`` holds no checkpoint (a typo must not train from scratch).
        """
        self.finalize()
        rejected: set[str] = set()
        optim = optimizer if load_optim else None
        while True:
            choice = self._decide(iteration, rejected)
            if choice is None:
                return None
            started = time.monotonic()
            problem, loaded = self._load_choice(choice, model, optim, strict, check_common)
            if problem is None and loaded is not None:
                if self._rank == 0:
                    _say_loaded(loaded, time.monotonic() - started)
                return loaded
            # A copy (local, in-memory) that failed is passed over whatever --ckpt-fallback says.
            copy = isinstance(choice, CopyChoice) and choice.from_tier
            what = choice.resume.detail if isinstance(choice, CopyChoice) else choice.path
            if not copy and (not self._fallback or iteration is not None):
                disk = choice.disk if isinstance(choice, CopyChoice) else choice
                assert disk is not None
                raise load_failure(disk, problem, explicit=iteration is not None)
            flag = "" if copy else " (--ckpt-fallback)"
            logger.warning("checkpoint %s unusable (%s); falling back%s", what, problem, flag)
            rejected.add(choice.rejected_key() if isinstance(choice, CopyChoice) else choice.path)

    def _load_choice(
        self,
        choice: Choice | CopyChoice,
        model: nn.Module,
        optimizer: Optimizer | None,
        strict: bool,
        check_common: Callable[[dict[str, Any]], None] | None,
    ) -> tuple[str | None, LoadedCheckpoint | None]:
        if isinstance(choice, CopyChoice) and choice.from_tier:
            assert self._copies is not None
            load = functools.partial(self._copies.load, strict=strict, check_common=check_common)
            return resume.load_copy(choice, load, model, optimizer, self._load_dir)
        disk = choice.disk if isinstance(choice, CopyChoice) else choice
        assert disk is not None
        return try_load(
            disk,
            model,
            optimizer,
            strict=strict,
            check_common=check_common,
            rank=self._rank,
            world_size=self._world_size,
            group=self._group,
        )

    def _decide(self, iteration: int | None, rejected: set[str]) -> Choice | CopyChoice | None:
        where = resume.Roots(self._load_dir, self._np_dir, self._load_explicit)
        decider = resume.Decider(where, self._locator(), self._copies, self._group)
        return decider.decide(iteration, rejected, self._rank, self._src)

    # ------------------------------------------------------------------- close
    def close(self, *, abort: bool = False) -> None:
        """Stop async machinery. ``abort=False``: finalize (collective) an in-flight save.

        ``abort=True`` (in-process restart after a fault; no collectives): an in-flight save is
        discarded, never committed; its tmp directory is removed by the next save.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._close_writes(abort)
        finally:
            try:
                if self._copies is not None:
                    self._copies.close(abort=abort)
            finally:
                self._locks.release()  # every exit path: the next job may use the directory

    def _close_writes(self, abort: bool) -> None:
        try:
            if abort:
                if self._pending is not None:
                    logger.warning(
                        "discarding in-flight async checkpoint %s", self._pending.tmp_path
                    )
                self._pending = None
            else:
                self.finalize()
        finally:
            if self._async is not None:
                self._async.close(wait=not abort)
                self._async = None
            if self._ckpt_group is not None and not abort:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(self._ckpt_group)
            self._ckpt_group = None


def _say_loaded(loaded: Any, seconds: float) -> None:
    """The notice of a resume (shown by default: `stalwart.log_notice`)."""
    message = "loaded checkpoint iteration %d from %s in %.2fs"
    where = loaded.source or loaded.path  # a local or in-memory copy names itself
    logger.info(message, loaded.iteration, where, seconds, extra=NOTICE)
