"""Node-local checkpoints (``--non-persistent-ckpt-type local``): every rank writes its shard
to its node's directory in the background and, with ``--replication``, to its holders
over the process group; a resume reads the newest iteration complete across all ranks'
directories, replicas included.

A save blocks only for the host copy (`stalwart.checkpoint.staging`); a background thread then
swaps shards with the holders (`stalwart.checkpoint.replication`, gloo) and writes the own
shard and the received ones (`stalwart.checkpoint.local_layout`: atomic, checksummed). The next
``maybe_finalize`` (top of a step) asks every rank whether its write is done (one all-reduce,
only while one is in flight); once every rank's is, the iteration is complete everywhere and
each rank removes its older iterations. A save that failed on some rank is one warning: training
goes on, and the last complete copy stays.

With ``fully_parallel`` (Megatron's default algorithm) the tensors that every data-parallel
rank holds alike (all of them under DDP) are spread over the ranks, each rank storing its part
(the largest tensors first, each to the rank with the fewest bytes so far): a save writes the
state once across the job, not once per rank, and a resume broadcasts every part to every rank.
``atomic`` stores a rank's whole state in its shard. A sharded state (FSDP2's DTensors) is
always stored by its rank.

Example (one process; in a job every rank calls every method)::

    >>> import tempfile, torch
    >>> from stalwart.checkpoint import dcp_io
    >>> model = torch.nn.Linear(2, 2)
    >>> local = LocalCheckpoints(tempfile.mkdtemp())
    >>> local.check_writable()
    >>> local.save(3, dcp_io.gather_state(model, None), {"it": 3}, {"seed": 1})
    >>> local.maybe_finalize(blocking=True)
    3
    >>> plan = local.plan([local.report()], exclude=set())
    >>> plan.iteration, local.load(plan.plan, model, None, strict=True, check_common=None)[1][0]
    (3, {'it': 3})
    >>> local.close()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import dcp_io, layout, local_layout, replication
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.local_plan import (
    ATOMIC,
    FULLY_PARALLEL,
    CopyKind,
    Held,
    LocalPlan,
    Transfer,
    plan_local,
    source_owner,
)
from stalwart.checkpoint.lock import SaveDirLock
from stalwart.checkpoint.replication import Replication
from stalwart.checkpoint.safe_state import StateFormatError
from stalwart.checkpoint.shard_format import (
    Shard,
    device_first,
    encode_header,
    local_part,
    parse_shard,
    read_facts,
    split_tensors,
    tensor_bytes,
    tensor_table,
)
from stalwart.checkpoint.staging import HostStager, Staged
from stalwart.checkpoint.state_fill import load_into_model, materialize
from stalwart.distributed import collectives

logger = logging.getLogger("stalwart.checkpoint")
LOCAL_ALGOS = (FULLY_PARALLEL, ATOMIC)


@dataclass(frozen=True)
class TierPlan:
    """What a copy tier offers every rank to load: ``iteration``, the tier's own ``plan``, why
    a newer copy of the tier is not usable (``why``) and where the bytes come from (``where``)."""

    iteration: int | None
    plan: Any = None
    why: str | None = None
    where: str = ""


@dataclass
class _Pending:
    iteration: int
    future: concurrent.futures.Future
    started: float


class _Writer:
    """One daemon thread that runs the background part of each save in turn (a write stuck on
    a dead peer never blocks the interpreter's exit; no thread to start per save)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="stalwart-local-ckpt", daemon=True
            )
            self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # reported by maybe_finalize
                    future.set_exception(exc)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


def assign_owners(sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """``fully_parallel``'s owner of each replicated tensor: the largest first, each to the
    rank with the fewest bytes so far (the lowest on a tie). Pure: the same on every rank.

    >>> assign_owners([("a", 8), ("b", 4), ("c", 4)], 2)
    {'a': 0, 'b': 1, 'c': 1}
    """
    loads = [0] * world_size
    owners = {}
    for path, nbytes in sorted(sizes, key=lambda item: (-item[1], item[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[path] = owner
        loads[owner] += nbytes
    return owners


class LocalCheckpoints:
    """Local copies of one job session (see module docstring). Collective to construct (a gloo
    group for the shards' bytes; the session's token).

    Args:
        local_dir: ``--non-persistent-local-ckpt-dir`` (each node's own directory).
        algo: ``--non-persistent-local-ckpt-algo``: ``fully_parallel`` or ``atomic``.
        replication: ``--replication-jump/--replication-factor`` (None: no replicas; fewer
            copies than asked for, a world too small or replicas on their owner's node, is one
            warning).
        process_group: the group the checkpoint spans (default: the world).
        job_id: this job's identity for the directory locks (see `stalwart.checkpoint.lock`).
        job: whose copies these are (the trainer: ``--save``'s real path; default: the local
            directory's): copies of another job in the directory are never loaded or deleted.
    """

    kind = CopyKind.LOCAL

    def __init__(
        self,
        local_dir: str,
        *,
        algo: str = FULLY_PARALLEL,
        replication: Replication | None = None,
        process_group: Any = None,
        job_id: str | None = None,
        job: str | None = None,
    ) -> None:
        if algo not in LOCAL_ALGOS:
            raise ValueError(
                f"--non-persistent-local-ckpt-algo: got {algo!r}, allowed: {', '.join(LOCAL_ALGOS)}"
            )
        self._algo = algo
        self._group = process_group
        self._rank, self._world, self._src = dcp_io.group_rank_info(process_group)
        self.place = local_layout.NodePlace.from_env(local_dir, self._rank, self._world)
        self.replication = replication or Replication()
        self._own_dir = self.place.rank_dir(self._rank)
        self._job = job if job is not None else os.path.realpath(local_dir)
        self._io_group = dcp_io.new_checkpoint_group(process_group)
        token = local_layout.save_token() if self._rank == 0 else None
        self._session = str(collectives.broadcast_object(token, self._src, process_group))
        first = self.place.local_rank == 0
        flag = local_layout.LOCAL_FLAG
        self._lock = SaveDirLock(self.place.root, flag=flag, job_id=job_id) if first else None
        self._stager: HostStager | None = None
        self._pending: _Pending | None = None
        self._writer = _Writer()
        self._warn_same_node()

    def _warn_same_node(self) -> None:
        short = self.replication.shortfall(self._world, self.place.ranks_per_node)
        if self._rank == 0 and short is not None:
            logger.warning("%s", short)

    def bind(self, process_group: Any) -> None:
        """The manager's group (this tier was built for it)."""
        del process_group

    # ------------------------------------------------------------------ checks
    def check_writable(self) -> None:
        """Create this rank's directory, probe it, take the node's lock (collective).

        Raises:
            ValueError: on every rank, naming the first problem any rank found.
        """
        problem = None
        try:
            local_layout.ensure_node_root(self.place)
            local_layout.ensure_own_dir(self._own_dir)
            problem = layout.probe_writable(self._own_dir, local_layout.LOCAL_FLAG, self._rank)
            if problem is None and self._lock is not None:
                self._lock.acquire()
        except (OSError, ValueError, CheckpointError) as exc:
            problem = str(exc)
        problems = collectives.all_gather_objects(problem, self._group)
        found = next((p for p in problems if p), None)
        if found is not None:
            raise ValueError(str(found))

    # -------------------------------------------------------------------- save
    def _owned(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._algo == ATOMIC or self._world == 1:
            return tensors
        replicated = [
            (path, t.numel() * t.element_size())
            for path, t in tensors.items()
            if path.startswith('["state"') and not local_part(t)[1]
        ]
        owners = assign_owners(replicated, self._world)
        return {p: t for p, t in tensors.items() if owners.get(p, self._rank) == self._rank}

    def save(
        self,
        iteration: int,
        state: dict[str, Any],
        common: dict[str, Any],
        per_rank: dict[str, Any],
    ) -> None:
        """Copy this rank's shard of ``iteration`` to host memory, then write it (and swap it
        with the clique) in the background. An earlier save is finalized (blocking) first."""
        self.maybe_finalize(blocking=True)
        skeleton, tensors = split_tensors({"state": state, "common": common, "per_rank": per_rank})
        mine = device_first(self._owned(tensors))
        sharded = any(local_part(t)[1] for t in tensors.values())
        table, size = tensor_table(mine)
        save_id = f"{self._session}:{iteration}"
        facts = local_layout.shard_facts(
            iteration, self._rank, self._world, self._algo, save_id, sharded, self._job
        )
        header = encode_header(facts, skeleton, table)
        parts = [local_part(t)[0] for t in mine.values()]
        staged = self._stager_for(parts).stage(parts, table, size)
        future = self._writer.submit(lambda: self._write(facts, header, staged))
        self._pending = _Pending(iteration, future, time.monotonic())

    def _stager_for(self, tensors: list[torch.Tensor]) -> HostStager:
        if self._stager is None:
            device = next((t.device for t in tensors if t.device.type != "cpu"), None)
            self._stager = HostStager(device or torch.device("cpu"))
        return self._stager

    def _write(self, facts: dict[str, Any], header: bytes, staged: Staged) -> None:
        """The background part: wait for the host copy, swap with the peers, write."""
        staged.wait()
        rank, world = self._rank, self._world
        peers = self.replication.receives_from(rank, world)
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        received = replication.exchange(
            [head, staged.data],
            [self._global(p) for p in self.replication.sends_to(rank, world)],
            [self._global(p) for p in peers],
            self._io_group,
        )
        local_layout.remove_leftovers(self._own_dir, logger)
        local_layout.write_shard(self._own_dir, facts, header, staged.data)
        for peer in peers:
            their_head, their_data = received[self._global(peer)]
            raw = bytes(their_head.numpy())
            theirs = read_facts(raw, f"rank {peer}'s shard")
            if (theirs.get("owner"), theirs.get("iteration")) != (peer, facts["iteration"]):
                raise CheckpointError(f"rank {peer} sent a shard of another save: {theirs}")
            local_layout.write_shard(self._own_dir, theirs, raw, their_data)

    def _global(self, rank: int) -> int:
        if self._group is None or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self._group, rank)

    # ---------------------------------------------------------------- finalize
    def maybe_finalize(self, blocking: bool = False) -> int | None:
        """Once every rank wrote the in-flight save (one all-reduce while one is in flight):
        remove the older iterations, return its iteration. A failure warns (see module
        docstring) and returns None."""
        pending = self._pending
        if pending is None:
            return None
        if blocking:
            concurrent.futures.wait([pending.future])
        done = pending.future.done()
        failed = done and pending.future.exception() is not None
        # Deliberate sync: only while a local save is in flight; every rank must have written.
        any_not_done, any_failed = collectives.all_reduce_any([not done, failed], self._group)
        if any_not_done and not any_failed:
            return None
        if not done:
            concurrent.futures.wait([pending.future])  # never prune under a running writer
        self._pending = None
        if any_failed:
            self._warn_failed(pending, pending.future.exception())
            return None
        local_layout.prune(self._own_dir, pending.iteration, self._job, logger)
        if self._rank == 0:
            copies = self.replication.factor
            logger.info(
                "local checkpoint of iteration %d complete on every rank (%d cop%s of each "
                "shard) in %.2fs",
                pending.iteration,
                copies,
                "y" if copies == 1 else "ies",
                time.monotonic() - pending.started,
            )
        return pending.iteration

    def _warn_failed(self, pending: _Pending, cause: BaseException | None) -> None:
        if cause is not None:
            logger.warning(
                "local checkpoint of iteration %d failed on rank %d: %s; training goes on, "
                "the last complete local copy is kept",
                pending.iteration,
                self._rank,
                dcp_io.describe_failure(cause),
            )
        elif self._rank == 0:
            logger.warning(
                "local checkpoint of iteration %d failed on another rank; the last complete "
                "local copy is kept",
                pending.iteration,
            )

    # -------------------------------------------------------------------- load
    def report(self) -> list[Held]:
        """The complete shards of this job this rank can read: its share of its node's rank
        directories (another job's copies there: one warning)."""
        dirs = local_layout.rank_dirs(self.place.root, logger)
        per_node, mine = self.place.ranks_per_node, self.place.local_rank
        found = [
            f
            for i, (_, path) in enumerate(dirs)
            if i % per_node == mine
            for f in local_layout.scan(path, logger)
        ]
        foreign = sorted({f.job for f in found if f.job != self._job})
        if foreign:
            logger.warning(
                "local copies in %s belong to another job (%s), not this one (%s): not used",
                self.place.root,
                ", ".join(foreign)[:200],
                self._job,
            )
        return [
            Held(
                self._rank, f.iteration, f.owner, f.world_size, f.algo, f.save_id, f.sharded, f.path
            )
            for f in found
            if f.job == self._job
        ]

    def plan(self, reports: list[Any], exclude: set[int]) -> TierPlan:
        """The newest complete iteration of every rank's ``report`` (pure; not in ``exclude``)."""
        held = [h for report in reports for h in report if h.iteration not in exclude]
        plan, why = plan_local(held, self._world)
        if why is not None and "lacks" in why and self.replication.factor == 1:
            why += "; --replication is off"
        if plan is None:
            return TierPlan(None, None, why)
        notes = [f"rank {t.owner}'s shard from rank {t.holder}'s directory" for t in plan.replicas]
        where = "; ".join([*plan.skipped, *notes])
        return TierPlan(plan.iteration, plan, why if why else None, where)

    def load(
        self,
        plan: LocalPlan,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        strict: bool,
        check_common: Callable[[dict[str, Any]], None] | None,
    ) -> tuple[str | None, tuple[dict[str, Any], dict[str, Any] | None, int] | None]:
        """Read the plan's shards, send each to the ranks that need it, restore (collective).
        Returns ``(problem, None)`` when any rank failed, else ``(None, (common, per_rank,
        saved world size))``; ``check_common``'s ``ValueError`` propagates."""
        shards, problem = self._fetch(plan)
        if collectives.all_reduce_any([problem is not None], self._group)[0]:
            return (
                problem or f"local checkpoint of iteration {plan.iteration} failed on a peer",
                None,
            )
        own = shards[source_owner(self._rank, plan.saved_world)]
        where = f"local checkpoint of iteration {plan.iteration}"
        tensors = {p: t for s in shards.values() for p, t in s.tensors.items()}
        common = materialize(own.skeleton["common"], tensors, where)
        per_rank = None
        if self._rank < plan.saved_world:
            per_rank = materialize(own.skeleton["per_rank"], tensors, where)
        if check_common is not None:
            check_common(common)  # the same on every rank: every rank raises alike
        try:
            load_into_model(
                model, optimizer, own.skeleton["state"], tensors, strict=strict, where=where
            )
        except CheckpointError as exc:
            problem = str(exc)
        if collectives.all_reduce_any([problem is not None], self._group)[0]:
            return problem or f"{where} failed to load on another rank", None
        return None, (common, per_rank, plan.saved_world)

    def _fetch(self, plan: LocalPlan) -> tuple[dict[int, Shard], str | None]:
        shards: dict[int, Shard] = {}
        problem = None
        for transfer in plan.transfers:
            try:
                shard = self._move(transfer, plan.iteration)
            except (CheckpointError, StateFormatError) as exc:
                problem, shard = problem or str(exc), None
            if shard is not None:
                shards[transfer.owner] = shard
        return shards, problem

    def _move(self, transfer: Transfer, iteration: int) -> Shard | None:
        """One shard from its holder to its receivers; this rank's copy when it is one."""
        others = [self._global(r) for r in transfer.receivers if r != self._rank]
        where = f"rank {transfer.owner}'s local shard of iteration {iteration}"
        if transfer.holder == self._rank:
            try:
                blob = local_layout.read_shard(transfer.path)
            except CheckpointError:
                replication.send_to([torch.empty(0, dtype=torch.uint8)], others, self._io_group)
                raise
            data = torch.frombuffer(blob, dtype=torch.uint8)
            replication.send_to([data], others, self._io_group)
        elif self._rank in transfer.receivers:
            (data,) = replication.receive_from(self._global(transfer.holder), 1, self._io_group)
            if not data.numel():
                raise CheckpointError(f"{where}: rank {transfer.holder} could not read it")
        else:
            return None
        if self._rank not in transfer.receivers:
            return None
        return _checked(data, transfer, iteration, where)

    # ------------------------------------------------------------------- close
    def close(self, *, abort: bool = False) -> None:
        """Finalize (collective) unless ``abort``; release the node's lock and the group."""
        try:
            if not abort:
                self.maybe_finalize(blocking=True)
        finally:
            self._pending = None
            self._writer.stop()
            if self._lock is not None:
                self._lock.release()
            if self._io_group is not None and not abort:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(self._io_group)
            self._io_group = None


def _checked(data: torch.Tensor, transfer: Transfer, iteration: int, where: str) -> Shard:
    shard = parse_shard(tensor_bytes(data), where)
    if (shard.facts.get("owner"), shard.facts.get("iteration")) != (transfer.owner, iteration):
        raise CheckpointError(f"{where}: {transfer.path} holds another shard")
    for key in ("common", "per_rank", "state"):
        if not isinstance(shard.skeleton, dict) or key not in shard.skeleton:
            raise CheckpointError(f"{where}: {transfer.path} has no {key!r} state")
    return shard
