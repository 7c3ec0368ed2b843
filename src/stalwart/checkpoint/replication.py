"""Which ranks hold copies of each other's local checkpoint (``--replication``), and moving a
shard's bytes between ranks over a process group (no shared storage needed).

Clique replication, as Megatron's ``--replication-jump J --replication-factor K``: the world is
cut into blocks of ``J * K`` consecutive ranks, and inside a block the ranks ``r, r + J, ...,
r + (K - 1) J`` form a clique whose members each store every member's shard. With ``J`` the
ranks per node (the default), a clique spans ``K`` nodes, so losing a node loses no shard while
fewer than ``K`` nodes of a clique are gone.

    >>> CliqueReplication(jump=2, factor=2).clique(1, world_size=8)
    [1, 3]
    >>> CliqueReplication(jump=2, factor=2).clique(6, world_size=8)
    [4, 6]
    >>> CliqueReplication(jump=1, factor=1).clique(3, world_size=4)   # replication off
    [3]

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


@dataclass(frozen=True)
class CliqueReplication:
    """``jump`` (ranks between two members of a clique) and ``factor`` (members per clique;
    1: no replication)."""

    jump: int = 1
    factor: int = 1

    def check(self, world_size: int) -> None:
        """``ValueError`` naming the flags unless the cliques tile ``world_size``."""
        block = self.jump * self.factor
        if self.jump < 1 or self.factor < 1 or world_size % block:
            raise ValueError(
                f"--replication: the world size ({world_size}) must be a multiple of "
                f"--replication-jump ({self.jump}) x --replication-factor ({self.factor}); "
                "the jump is the ranks per node by default, so replicas land on other nodes"
            )

    def clique(self, rank: int, world_size: int) -> list[int]:
        """The ranks that hold ``rank``'s shard (``rank`` included), ascending."""
        if self.factor == 1:
            return [rank]
        block = self.jump * self.factor
        base = (rank // block) * block + rank % self.jump
        return [base + i * self.jump for i in range(self.factor)]

    def peers(self, rank: int, world_size: int) -> list[int]:
        """The other members of ``rank``'s clique."""
        return [r for r in self.clique(rank, world_size) if r != rank]


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def exchange(
    parts: list[torch.Tensor], peers: list[int], group: Any
) -> dict[int, list[torch.Tensor]]:
    """Send ``parts`` (contiguous CPU ``uint8`` tensors: a shard's header and data) to every
    peer and receive each peer's parts (collective among a clique: each member calls it with
    the others as ``peers``). Ranks are global ranks; sizes go first, then the bytes.

    Raises:
        RuntimeError: a peer went away (gloo's error, on this rank's thread).
    """
    if not peers:
        return {}
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    theirs = {peer: torch.empty(len(parts), dtype=torch.int64) for peer in peers}
    requests = [dist.isend(sizes, peer, group=group) for peer in peers]
    requests += [dist.irecv(theirs[peer], peer, group=group) for peer in peers]
    _wait(requests)
    received = {
        peer: [torch.empty(int(n), dtype=torch.uint8) for n in theirs[peer].tolist()]
        for peer in peers
    }
    requests = []
    for peer in peers:
        requests += [dist.isend(part, peer, group=group) for part in parts if part.numel()]
        requests += [
            dist.irecv(buffer, peer, group=group) for buffer in received[peer] if buffer.numel()
        ]
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


__all__ = ["CliqueReplication", "exchange", "receive_from", "send_to"]
