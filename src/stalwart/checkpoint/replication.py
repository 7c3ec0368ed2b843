"""Which ranks hold copies of each other's local checkpoint (``--replication``), and moving a
shard's bytes between ranks over a process group (no shared storage needed).

Megatron's ``--replication-jump J --replication-factor K``: rank ``r``'s shard is held by ranks
``r, r + J, ..., r + (K - 1) J`` (modulo the world size), so each rank stores its own shard and
the shards of ``r - J, ..., r - (K - 1) J``. With ``J`` the ranks per node (the default), the
``K`` copies of a shard are on ``K`` different nodes, and losing fewer than ``K`` nodes loses no
shard. The ring works for every world size: after an exclusion shrinks the job, a shard has as
many copies as there are distinct holders (one line warns when that is fewer than ``K``).

    >>> Replication(jump=2, factor=2).holders(1, world_size=8)
    [1, 3]
    >>> Replication(jump=2, factor=3).receives_from(1, world_size=8)
    [7, 5]
    >>> Replication(jump=1, factor=2).holders(0, world_size=1)   # one rank: no replica
    [0]

The bytes move over a gloo group in every case (a checkpoint's own group, see
`stalwart.checkpoint.dcp_io.new_checkpoint_group`): they are already in host memory, and the
exchange runs on a background thread, where NCCL kernels of a second communicator could
deadlock against the training's own if the ranks issued them in different orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _distinct(ranks: list[int]) -> list[int]:
    return list(dict.fromkeys(ranks))


@dataclass(frozen=True)
class Replication:
    """``jump`` (ranks between two holders of a shard) and ``factor`` (holders per shard, the
    owner included; 1: no replication)."""

    jump: int = 1
    factor: int = 1

    def holders(self, rank: int, world_size: int) -> list[int]:
        """The ranks that store ``rank``'s shard, the owner first."""
        return _distinct([(rank + i * self.jump) % world_size for i in range(self.factor)])

    def sends_to(self, rank: int, world_size: int) -> list[int]:
        return self.holders(rank, world_size)[1:]

    def receives_from(self, rank: int, world_size: int) -> list[int]:
        """The ranks whose shards ``rank`` stores besides its own."""
        owners = [(rank - i * self.jump) % world_size for i in range(self.factor)]
        return [r for r in _distinct(owners) if r != rank]

    def shortfall(self, world_size: int, ranks_per_node: int) -> str | None:
        """Why some shard has fewer than ``factor`` copies on distinct nodes; None if none."""
        nodes = {
            len({h // ranks_per_node for h in self.holders(r, world_size)})
            for r in range(world_size)
        }
        fewest = min(nodes)
        if self.factor == 1 or fewest >= self.factor:
            return None
        return (
            f"--replication: with {world_size} rank(s), {ranks_per_node} per node and "
            f"--replication-jump {self.jump}, some shards are on only {fewest} node(s), not "
            f"--replication-factor {self.factor}: losing their node loses them"
        )


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def exchange(
    parts: list[torch.Tensor], sends_to: list[int], receives_from: list[int], group: Any
) -> dict[int, list[torch.Tensor]]:
    """Send ``parts`` (contiguous CPU ``uint8`` tensors: a shard's header and data) to every
    rank of ``sends_to`` and receive the parts of every rank of ``receives_from`` (each rank
    calls it with the lists of `Replication`, so every send has its receive). Ranks are global
    ranks; the sizes go first, then the bytes.

    Raises:
        RuntimeError: a peer went away (gloo's error, on this rank's thread).
    """
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    theirs = {peer: torch.empty(len(parts), dtype=torch.int64) for peer in receives_from}
    requests = [dist.isend(sizes, peer, group=group) for peer in sends_to]
    requests += [dist.irecv(theirs[peer], peer, group=group) for peer in receives_from]
    _wait(requests)
    received = {
        peer: [torch.empty(int(n), dtype=torch.uint8) for n in theirs[peer].tolist()]
        for peer in receives_from
    }
    requests = []
    for peer in sends_to:
        requests += [dist.isend(part, peer, group=group) for part in parts if part.numel()]
    for peer in receives_from:
        requests += [dist.irecv(b, peer, group=group) for b in received[peer] if b.numel()]
    _wait(requests)
    return received


def send_to(parts: list[torch.Tensor], receivers: list[int], group: Any) -> None:
    """Send ``parts`` to each receiver (the sending half of :func:`receive_from`)."""
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    requests = []
    for receiver in receivers:
        requests.append(dist.isend(sizes, receiver, group=group))
        requests += [dist.isend(p, receiver, group=group) for p in parts if p.numel()]
    _wait(requests)


def receive_from(sender: int, count: int, group: Any) -> list[torch.Tensor]:
    """``count`` parts sent by ``sender`` with :func:`send_to` (writable ``uint8`` tensors)."""
    sizes = torch.empty(count, dtype=torch.int64)
    dist.recv(sizes, sender, group=group)
    parts = [torch.empty(int(n), dtype=torch.uint8) for n in sizes.tolist()]
    for part in parts:
        if part.numel():
            dist.recv(part, sender, group=group)
    return parts


__all__ = ["Replication", "exchange", "receive_from", "send_to"]
