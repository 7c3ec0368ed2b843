"""In-memory snapshots (``--non-persistent-ckpt-type in_memory``): a rank's whole state in host
memory, for an in-process restart (``--inprocess-restart``) that then reads nothing from disk.

The snapshots outlive the attempts of an in-process restart: the caller creates one
`InMemorySnapshots` outside the restartable scope and hands it to each attempt's
`stalwart.checkpoint.CheckpointManager`, which binds its own process group to it. A save blocks
only for the host copy (pinned memory filled by an asynchronous device-to-host copy, see
`stalwart.checkpoint.staging`); two host buffers are used in turn, so the last complete snapshot
survives a fault during the next copy. A resume agrees (one collective, the manager's) on the
newest iteration every rank holds and copies it back into the model, the optimizer and the
loop's parts. A process that dies takes its snapshots along: a relaunch resumes from disk.

    >>> import torch
    >>> from stalwart.checkpoint import dcp_io
    >>> model = torch.nn.Linear(2, 2)
    >>> snapshots = InMemorySnapshots()
    >>> snapshots.save(4, dcp_io.gather_state(model, None), {"it": 4}, {"seed": 1})
    >>> with torch.no_grad():
    ...     _ = model.weight.zero_()
    >>> offer = snapshots.plan([snapshots.report()], exclude=set())
    >>> problem, (common, per_rank, world) = snapshots.load(offer.plan, model, None, strict=True,
    ...                                                     check_common=None)
    >>> offer.iteration, common, bool(model.weight.abs().sum() > 0)
    (4, {'it': 4}, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint import dcp_io
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.local import TierPlan
from stalwart.checkpoint.local_plan import CopyKind, common_snapshot
from stalwart.checkpoint.safe_state import StateFormatError
from stalwart.checkpoint.shard_format import (
    device_first,
    encode_header,
    local_part,
    parse_parts,
    split_tensors,
    tensor_bytes,
    tensor_table,
)
from stalwart.checkpoint.staging import HostStager, Staged
from stalwart.checkpoint.state_fill import load_into_model, materialize
from stalwart.distributed import collectives

logger = logging.getLogger("stalwart.checkpoint")


@dataclass
class _Snapshot:
    iteration: int
    world_size: int
    header: bytes
    staged: Staged


class InMemorySnapshots:
    """The last two snapshots of this rank, in host memory (see module docstring).

    Args:
        slots: snapshots kept (at least 2: one complete while the next is copied).
    """

    kind = CopyKind.IN_MEMORY

    def __init__(self, slots: int = 2) -> None:
        if slots < 2:
            raise ValueError(f"InMemorySnapshots: slots must be >= 2, got {slots}")
        self._slots: list[_Snapshot | None] = [None] * slots
        self._stager: HostStager | None = None
        self._group: Any = None
        self._rank, self._world = 0, 1

    def bind(self, process_group: Any) -> None:
        """The group of the attempt that uses the snapshots now (its manager calls this)."""
        self._group = process_group
        self._rank, self._world, _ = dcp_io.group_rank_info(process_group)

    def check_writable(self) -> None:
        """Nothing to check: host memory."""

    def save(
        self,
        iteration: int,
        state: dict[str, Any],
        common: dict[str, Any],
        per_rank: dict[str, Any],
    ) -> None:
        """Start the host copy of this rank's state of ``iteration`` into the next buffer."""
        skeleton, tensors = split_tensors({"state": state, "common": common, "per_rank": per_rank})
        tensors = device_first(tensors)
        table, size = tensor_table(tensors)
        header = encode_header({"iteration": iteration}, skeleton, table)
        parts = [local_part(t)[0] for t in tensors.values()]
        if self._stager is None:
            device = next((t.device for t in parts if t.device.type != "cpu"), None)
            self._stager = HostStager(device or torch.device("cpu"), slots=len(self._slots))
        slot = self._stager.next_slot
        self._slots[slot] = None  # that buffer is overwritten now
        staged = self._stager.stage(parts, table, size)
        self._slots[staged.slot] = _Snapshot(iteration, self._world, header, staged)

    def maybe_finalize(self, blocking: bool = False) -> int | None:
        """Nothing is agreed at save time (the resume agrees)."""
        del blocking
        return None

    def report(self) -> list[int]:
        """The iterations of the complete snapshots (waits for a copy still in flight)."""
        ready = []
        for snapshot in self._slots:
            if snapshot is None or snapshot.world_size != self._world:
                continue
            try:
                snapshot.staged.wait()
            except RuntimeError as exc:  # a broken device: its copy cannot be trusted
                logger.warning(
                    "in-memory snapshot of iteration %d is lost: %s", snapshot.iteration, exc
                )
                continue
            ready.append(snapshot.iteration)
        return ready

    def plan(self, reports: list[Any], exclude: set[int]) -> TierPlan:
        """The newest iteration every rank holds (pure)."""
        iteration, why = common_snapshot([[i for i in r if i not in exclude] for r in reports])
        return TierPlan(iteration, iteration, why)

    def load(
        self,
        plan: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        strict: bool,
        check_common: Callable[[dict[str, Any]], None] | None,
    ) -> tuple[str | None, tuple[dict[str, Any], dict[str, Any] | None, int] | None]:
        """Restore the snapshot of iteration ``plan`` (collective: one agreement on success)."""
        where = f"in-memory snapshot of iteration {plan}"
        problem = None
        try:
            snapshot = next(s for s in self._slots if s is not None and s.iteration == plan)
            shard = parse_parts(snapshot.header, tensor_bytes(snapshot.staged.data), where)
            common = materialize(shard.skeleton["common"], shard.tensors, where)
            per_rank = materialize(shard.skeleton["per_rank"], shard.tensors, where)
        except (StopIteration, StateFormatError, CheckpointError, KeyError) as exc:
            problem = f"{where}: {exc or type(exc).__name__}"
        if collectives.all_reduce_any([problem is not None], self._group)[0]:
            return problem or f"{where} is gone on another rank", None
        if check_common is not None:
            check_common(common)
        try:
            load_into_model(
                model, optimizer, shard.skeleton["state"], shard.tensors, strict=strict, where=where
            )
        except CheckpointError as exc:
            problem = str(exc)
        if collectives.all_reduce_any([problem is not None], self._group)[0]:
            return problem or f"{where} failed to load on another rank", None
        return None, (common, per_rank, self._world)

    def close(self, *, abort: bool = False) -> None:
        """The snapshots stay: they outlive the attempt that saved them."""
        del abort

    def release(self) -> None:
        """Drop every snapshot and host buffer (the owner, once no attempt follows)."""
        self._slots = [None] * len(self._slots)
        self._stager = None


__all__ = ["InMemorySnapshots"]
