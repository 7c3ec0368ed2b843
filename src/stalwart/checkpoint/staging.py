"""The host copy of a local or in-memory snapshot, taken without stalling the step.

`HostStager` copies a list of tensors into one reusable host buffer, laid out as a shard's data
(`stalwart.checkpoint.shard_format.tensor_table`), so that the bytes can be written to a file
or sent to a peer as they are.

On CUDA the copy has two legs. The tensors are first copied into a device buffer on the current
stream, in order with the step (at HBM bandwidth: about a millisecond for a GB), and a side
stream then copies that buffer to pinned host memory while training goes on; the caller's
thread never waits. Before the device buffer is written again, the current stream waits for
the previous host copy on the device (no host sync). When the device has no room for the buffer,
the side stream copies the live tensors directly and the current stream waits for it before
its next kernel: still no host sync, but the step stalls for the copy (one warning says so).
CPU tensors among them are copied on the caller's thread (see :meth:`HostStager.stage`).
On the CPU the copy is one memcpy per tensor on the caller's thread.

    >>> import torch
    >>> from stalwart.checkpoint.shard_format import tensor_table
    >>> tensors = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.int64)}
    >>> table, size = tensor_table(tensors)
    >>> staged = HostStager(torch.device("cpu")).stage(list(tensors.values()), table, size)
    >>> staged.wait()
    >>> staged.view(table[0]).tolist(), staged.view(table[1]).tolist()
    ([0.0, 1.0, 2.0, 3.0], [1, 1])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint.shard_format import DTYPES, TensorEntry

logger = logging.getLogger("stalwart.checkpoint")


def entry_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor of ``entry`` inside a flat ``uint8`` buffer laid out by its table."""
    dtype = DTYPES[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype, device=buffer.device)
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(dtype).view(entry.shape)


@dataclass
class Staged:
    """A host copy being taken: ``data`` (``uint8``, the shard's data layout) is complete once
    :meth:`wait` returns (a host sync: call it on a background thread, or when it is done)."""

    data: torch.Tensor
    slot: int
    done: Any = None  # a CUDA event; None on the CPU (the copy was synchronous)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def ready(self) -> bool:
        """Whether the copy finished (no wait)."""
        return self.done is None or bool(self.done.query())

    def view(self, entry: TensorEntry) -> torch.Tensor:
        return entry_view(self.data, entry)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, in one foreach launch where torch has it (hundreds
    of tensors)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach([d for d, _ in pairs], [s for _, s in pairs])
        return
    for dst, src in pairs:
        dst.copy_(src)


class HostStager:
    """Reusable host buffers (pinned on CUDA) filled from tensors (see module docstring).

    Args:
        device: the device the tensors live on (CPU tensors are copied on the caller's thread).
        slots: host buffers used in turn: a buffer is written again only ``slots`` copies later
            (an in-memory snapshot keeps its last complete copy while the next one is taken).
    """

    def __init__(self, device: torch.device, slots: int = 1) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None] * slots
        self._host_done: list[Any] = [None] * slots
        self._next = 0
        self._device_buffer: torch.Tensor | None = None
        self._no_room = False
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self._last_d2h: Any = None

    @property
    def next_slot(self) -> int:
        """The host buffer the next :meth:`stage` writes."""
        return self._next

    def _host_buffer(self, slot: int, size: int) -> torch.Tensor:
        buffer = self._host[slot]
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=self.cuda)
            self._host[slot] = buffer
        return buffer[:size]

    def stage(self, tensors: list[torch.Tensor], table: list[TensorEntry], size: int) -> Staged:
        """Start copying ``tensors`` (in ``table``'s order) into the next host buffer. CPU
        tensors (an RNG state, a step count) are copied on the caller's thread and never go
        through the device (a copy from pageable memory could wait for the stream); put them
        after the device's in the table, so that one copy of the device buffer brings the rest.
        """
        slot, self._next = self._next, (self._next + 1) % len(self._host)
        if self._host_done[slot] is not None:
            self._host_done[slot].synchronize()  # that buffer's copy ended long ago: no wait
        host = self._host_buffer(slot, size)
        pairs = list(zip(tensors, table, strict=True))
        for tensor, entry in pairs:
            if tensor.device.type == "cpu":
                entry_view(host, entry).copy_(tensor.detach())
        device = [(t, e) for t, e in pairs if t.device.type != "cpu"]
        if not device or not self.cuda:
            return Staged(host, slot)
        end = max(e.offset + e.nbytes for _, e in device)
        after = all(e.offset >= end for t, e in pairs if t.device.type == "cpu")
        staging = self._device_copy(end) if after else None
        done = self._copy_from_device(device, host[:end] if after else host, staging)
        self._host_done[slot] = done
        return Staged(host, slot, done)

    def _device_copy(self, size: int) -> torch.Tensor | None:
        buffer = self._device_buffer
        if buffer is not None and buffer.numel() >= size:
            return buffer[:size]
        if self._no_room:
            return None
        self._device_buffer = None
        try:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            self._no_room = True
            logger.warning(
                "snapshot: no room on %s for a %.2f GB copy; the step waits for each host copy",
                self.device,
                size / 1e9,
            )
            return None
        self._device_buffer = buffer
        return buffer

    def _copy_from_device(
        self,
        pairs: list[tuple[torch.Tensor, TensorEntry]],
        host: torch.Tensor,
        staging: torch.Tensor | None,
    ) -> Any:
        current = torch.cuda.current_stream(self.device)
        if staging is not None:
            if self._last_d2h is not None:
                current.wait_event(self._last_d2h)  # the buffer's previous host copy is done
            _copy_all([(entry_view(staging, e), t.detach()) for t, e in pairs])
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            if staging is not None:
                host.copy_(staging, non_blocking=True)
            else:
                for tensor, entry in pairs:
                    entry_view(host, entry).copy_(tensor.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        if staging is None:
            current.wait_event(done)  # the live tensors must not change under the copy
        self._last_d2h = done
        return done


__all__ = ["HostStager", "Staged", "entry_view"]
