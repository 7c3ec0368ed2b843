"""Megatron's non-persistent checkpoint types (``--non-persistent-ckpt-type``) and the copies
each one builds for a `stalwart.checkpoint.CheckpointManager`:

* ``global``: a checkpoint directory like ``--save``'s (``--non-persistent-global-ckpt-dir``,
  default ``<save>/non_persistent``), written by the manager itself: no copies object;
* ``local``: `stalwart.checkpoint.local.LocalCheckpoints` in each node's
  ``--non-persistent-local-ckpt-dir``, replicated to peers with ``--replication``;
* ``in_memory``: `stalwart.checkpoint.in_memory.InMemorySnapshots` in host memory, for an
  in-process restart (the caller keeps one across the attempts and passes it in).

    >>> build_copies(NonPersistentType.GLOBAL) is None
    True
    >>> type(build_copies(NonPersistentType.IN_MEMORY)).__name__
    'InMemorySnapshots'
"""

from __future__ import annotations

import enum
from typing import Any

from stalwart.checkpoint import dcp_io
from stalwart.checkpoint.in_memory import InMemorySnapshots
from stalwart.checkpoint.local import LocalCheckpoints
from stalwart.checkpoint.local_layout import NodePlace
from stalwart.checkpoint.replication import Replication
from stalwart.checkpoint.resume import CopyTier

DEFAULT_REPLICATION_FACTOR = 2  # Megatron's --replication-factor default


class NonPersistentType(enum.StrEnum):
    """``--non-persistent-ckpt-type`` values (Megatron's spelling)."""

    GLOBAL = "global"
    LOCAL = "local"
    IN_MEMORY = "in_memory"


class LocalAlgo(enum.StrEnum):
    """``--non-persistent-local-ckpt-algo`` values: ``fully_parallel`` spreads the replicated
    state over the ranks (each writes its part), ``atomic`` writes each rank's whole state."""

    FULLY_PARALLEL = "fully_parallel"
    ATOMIC = "atomic"


def build_copies(
    kind: NonPersistentType,
    *,
    local_dir: str | None = None,
    algo: LocalAlgo = LocalAlgo.FULLY_PARALLEL,
    replication: bool = False,
    jump: int | None = None,
    factor: int | None = None,
    process_group: Any = None,
    job_id: str | None = None,
    job: str | None = None,
    snapshots: InMemorySnapshots | None = None,
) -> CopyTier | None:
    """The copies of ``kind`` (None for ``global``); collective for ``local``.

    ``jump`` defaults to the ranks per node (replicas on other nodes), ``factor`` to 2.
    ``job``: whose local copies (the trainer passes ``--save``'s real path).

    Raises:
        ValueError: naming the flag (no directory for ``local``).
    """
    if kind is NonPersistentType.GLOBAL:
        return None
    if kind is NonPersistentType.IN_MEMORY:
        return snapshots if snapshots is not None else InMemorySnapshots()
    if not local_dir:
        raise ValueError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir")
    clique = None
    if replication:
        rank, world, _ = dcp_io.group_rank_info(process_group)
        per_node = NodePlace.from_env(local_dir, rank, world).ranks_per_node
        clique = Replication(jump or per_node, factor or DEFAULT_REPLICATION_FACTOR)
    return LocalCheckpoints(
        local_dir,
        algo=algo.value,
        replication=clique,
        process_group=process_group,
        job_id=job_id,
        job=job,
    )


__all__ = ["LocalAlgo", "NonPersistentType", "build_copies"]
