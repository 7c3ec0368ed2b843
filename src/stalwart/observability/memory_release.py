"""``--empty-unused-memory-level``: hand cached, unused CUDA memory back, as Megatron does.

PyTorch's caching allocator keeps freed blocks for reuse; with variable shapes (evaluation, long
and short sequences) the cache fragments and ``memory_reserved`` grows. Megatron's flag empties
the cache at fixed points of the step, trading a little speed for headroom:

* level 0: never (default);
* level 1: after the forward-backward pass of every training iteration and after every
  evaluation iteration;
* level 2: level 1, and also after the optimizer step.

Usage in a hand-written loop::

    # A null object at level 0 or on CPU:
    release = MemoryReleaseConfig(empty_unused_memory_level=level).build(device)
    for it in range(iters):
        forward_backward(...)
        release.after_forward_backward()
        optimizer.step()
        release.after_optimizer_step()
    for _ in range(eval_iters):
        evaluate_step(...)
        release.after_eval_step()

``torch.cuda.empty_cache`` frees memory with ``cudaFree``, which waits for the device: each call is
a deliberate host sync, paid only at the levels the user asked for. Never call it inside a CUDA
graph capture (the trainer's points are all outside captured regions); blocks of a graph's
private pool stay allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def validate_empty_unused_memory_level(level: object) -> int:
    """The level as an int, or ``ValueError`` naming ``--empty-unused-memory-level``."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in (0, 1, 2):
        raise ValueError(f"--empty-unused-memory-level must be one of 0, 1, 2, got {level!r}")
    return level


class UnusedMemoryRelease:
    """Empties the allocator cache at the points of ``level`` (see the module docstring).

    Args:
        level: 1 or 2.
        empty_cache: the call that releases memory (default ``torch.cuda.empty_cache``; tests
            pass a recorder).
    """

    def __init__(self, level: int, empty_cache: Callable[[], None] | None = None) -> None:
        self.level = validate_empty_unused_memory_level(level)
        self._empty_cache = empty_cache or torch.cuda.empty_cache

    def after_forward_backward(self) -> None:
        self._release_from(1)

    def after_optimizer_step(self) -> None:
        self._release_from(2)

    def after_eval_step(self) -> None:
        self._release_from(1)

    def _release_from(self, level: int) -> None:
        if self.level >= level:
            # Deliberate sync: cudaFree waits for the device (the user asked for it).
            self._empty_cache()


class NullMemoryRelease:
    """Level 0, or a device without a caching allocator to empty: does nothing."""

    level = 0

    def after_forward_backward(self) -> None: ...
    def after_optimizer_step(self) -> None: ...
    def after_eval_step(self) -> None: ...


@dataclass(kw_only=True, frozen=True)
class MemoryReleaseConfig:
    """``--empty-unused-memory-level``: 0 off, 1 after each forward-backward and the optimizer
    step, 2 also after each evaluation step (CUDA only)."""

    empty_unused_memory_level: int = 0

    def __post_init__(self) -> None:
        validate_empty_unused_memory_level(self.empty_unused_memory_level)

    def build(self, device: torch.device) -> UnusedMemoryRelease | NullMemoryRelease:
        """The release on ``device``: a null object at level 0 or without CUDA."""
        if self.empty_unused_memory_level == 0 or device.type != "cuda":
            return NullMemoryRelease()
        return UnusedMemoryRelease(self.empty_unused_memory_level)
