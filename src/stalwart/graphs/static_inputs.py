"""Static (fixed-address) input buffers and input-signature checks for captured iterations.

A CUDA graph replays kernels with the pointers seen at capture, so every input a captured
iteration reads must live at the same address on every replay. :class:`StaticInputs` allocates
buffers matching the first structure it is given and afterwards copies new data into them in
place. Its :class:`InputSignature` (structure, shapes, dtypes, non-tensor leaves) detects a
changed workload, so a stale graph is never replayed with different shapes or micro-batch count.

When every tensor of the micro-batches is a contiguous view of one host buffer that they cover
exactly (``stalwart.data.MicroBatchIterator(chunk_microbatches=n)`` builds an iteration so), the
static buffers are views of one device buffer with the same layout, and a load is one copy of
the whole buffer instead of one per tensor (each copy is host work on the critical path of a
replayed iteration: at small model sizes the host, not the device, sets the pace).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from stalwart.tensor_tree import map_tensors, tensor_leaves

_CONST_TYPES = (type(None), bool, int, float, str)


def signature_of(obj: Any) -> Hashable:
    """Hashable description of a nested batch: containers, tensor shapes/dtypes, constant leaves.

    Tensors contribute ``(shape, dtype)`` (not their device: a CPU batch and a device batch copy
    into the same buffers). Non-tensor leaves (``None``, bool, int, float, str) are part of the
    signature because a graph freezes them at capture. Raises ``ValueError`` for other types.
    """
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.shape, obj.dtype)  # torch.Size is a tuple; dtypes hash
    if isinstance(obj, Mapping):
        return ("dict", tuple((key, signature_of(value)) for key, value in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(signature_of(value) for value in obj))
    if isinstance(obj, _CONST_TYPES):
        return ("const", obj)
    raise ValueError(
        f"unsupported value of type {type(obj).__name__} in a captured micro-batch; "
        "use tensors, dicts, lists, tuples or None/bool/int/float/str constants"
    )


@dataclasses.dataclass(frozen=True)
class InputSignature:
    """What a captured graph was specialised to: micro-batch count, batch structure, static
    kwargs."""

    num_microbatches: int
    batches: Hashable
    static_kwargs: Hashable

    def difference(self, other: InputSignature) -> str:
        """Human-readable reason why ``other`` cannot replay a graph captured for ``self``."""
        if self.num_microbatches != other.num_microbatches:
            return (
                f"num_microbatches changed from {self.num_microbatches} to {other.num_microbatches}"
            )
        if self.static_kwargs != other.static_kwargs:
            return f"static arguments changed from {self.static_kwargs} to {other.static_kwargs}"
        if self.batches != other.batches:
            return f"micro-batch shapes/dtypes changed from {self.batches} to {other.batches}"
        return "no difference"


@dataclasses.dataclass(frozen=True)
class _SharedLayout:
    """Where the leaves sat in the one host buffer they covered at allocation (element offsets
    from the buffer's start); a load whose leaves sit the same way copies the buffer at once."""

    numel: int
    dtype: torch.dtype
    offsets: tuple[int, ...]

    @staticmethod
    def of(leaves: list[torch.Tensor]) -> _SharedLayout | None:
        """The layout when every leaf is a contiguous view of one storage they cover exactly."""
        if len(leaves) < 2 or any(t.dtype != leaves[0].dtype for t in leaves):
            return None
        storage = leaves[0].untyped_storage()
        if any(
            not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
            for t in leaves
        ):
            return None
        size = leaves[0].element_size()
        if storage.nbytes() != sum(t.numel() for t in leaves) * size:
            return None  # not covered exactly: copying the whole storage could cost more
        return _SharedLayout(
            storage.nbytes() // size,
            leaves[0].dtype,
            tuple(int(t.storage_offset()) for t in leaves),
        )

    def source(self, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        """The whole host buffer as one tensor when ``leaves`` sit in it as at allocation: the
        same offsets from the first leaf's storage, contiguous (a leaf's address inside that
        storage is inside that memory, so the copy reads exactly its values)."""
        first = leaves[0]
        start = first.untyped_storage().data_ptr()
        if first.untyped_storage().nbytes() != self.numel * first.element_size():
            return None
        size = first.element_size()
        for t, offset in zip(leaves, self.offsets, strict=True):
            if t.data_ptr() != start + offset * size or not t.is_contiguous():
                return None
        return first.as_strided((self.numel,), (1,), 0)


def _copy_into(dst: Any, src: Any, whole: tuple[_SharedLayout, torch.Tensor] | None) -> None:
    srcs = tensor_leaves(src)  # same structure as dst: checked by the signature
    if whole is not None and srcs[0].dtype == whole[0].dtype:
        source = whole[0].source(srcs)
        if source is not None:
            whole[1].copy_(source, non_blocking=True)  # every leaf in one copy
            return
    dsts = tensor_leaves(dst)
    if len(dsts) > 1 and all(s.device == d.device for s, d in zip(srcs, dsts)):
        # Batches already on the device: one multi-tensor copy launch instead of one per tensor
        # (at small model sizes every launch outside the graph is visible in the step time).
        torch._foreach_copy_(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        # non_blocking: pinned host batches overlap with the previous replay; the copy is
        # stream-ordered before the replay on the same stream.
        d.copy_(s, non_blocking=True)


class StaticInputs:
    """Fixed-address buffers for the micro-batches of one captured stage (training or evaluation).

    ``load(batches)`` returns the same Python objects, backed by the same storage, on every call
    while the signature is unchanged; it raises ``ValueError`` if the signature differs from the
    one the buffers were allocated for (call :meth:`clear` first to re-allocate).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._buffers: Any = None
        self._signature: Hashable | None = None
        self._whole: tuple[_SharedLayout, torch.Tensor] | None = None  # one buffer, all leaves

    @property
    def allocated(self) -> bool:
        """True once buffers exist."""
        return self._signature is not None

    @property
    def signature(self) -> Hashable | None:
        """Signature of the allocated buffers, or None."""
        return self._signature

    @property
    def buffers(self) -> Any:
        """The static structure last returned by :meth:`load` (None before the first load)."""
        return self._buffers

    def load(self, batches: Any, signature: Hashable | None = None) -> Any:
        """Copy ``batches`` into the static buffers (allocating them on first use); return them.

        ``signature``: ``signature_of(batches)`` when the caller has it already (saves the walk).
        """
        signature = signature_of(batches) if signature is None else signature
        if self._signature is None:
            self._allocate(batches)
            self._signature = signature
        elif signature != self._signature:
            raise ValueError(
                "micro-batch structure/shape changed since the static buffers were allocated: "
                f"{self._signature} -> {signature}"
            )
        _copy_into(self._buffers, batches, self._whole)
        return self._buffers

    def _allocate(self, batches: Any) -> None:
        # Constant leaves stay as they are: frozen into the graph, checked by the signature.
        layout = _SharedLayout.of(tensor_leaves(batches))
        if layout is None:
            self._whole = None
            self._buffers = map_tensors(
                batches, lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device)
            )
            return
        base = torch.empty(layout.numel, dtype=layout.dtype, device=self.device)
        self._whole = (layout, base)
        self._buffers = map_tensors(
            batches, lambda t: base.as_strided(t.shape, t.stride(), t.storage_offset())
        )

    @property
    def coalesced(self) -> bool:
        """Whether the buffers are views of one device buffer (a load may be one copy)."""
        return self._whole is not None

    def data_ptrs(self) -> list[int]:
        """Addresses of all buffer tensors (for tests and debugging)."""
        return [t.data_ptr() for t in tensor_leaves(self._buffers)]

    def clear(self) -> None:
        """Drop the buffers; the next :meth:`load` allocates new ones."""
        self._buffers = None
        self._signature = None
        self._whole = None
