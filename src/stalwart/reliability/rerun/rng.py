"""Capture and restore every random generator a training step may consume.

Covers Python ``random``, NumPy's legacy global generator, the torch CPU generator, every CUDA
device generator (only when CUDA is already initialised, so capturing never initialises CUDA) and
any user generators registered on an :class:`RngStateTracker` instance (e.g. a tensor-parallel
RNG tracker). Reusable by checkpoint code.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class RngStateTracker:
    """Extra named generators to capture alongside the built-in ones (per instance, not global)."""

    def __init__(self) -> None:
        self._generators: dict[str, tuple[Callable[[], Any], Callable[[Any], object]]] = {}

    def register_generator(
        self, name: str, get: Callable[[], Any], set: Callable[[Any], object]
    ) -> None:
        """Add a generator: ``get()`` returns its state, ``set(state)`` restores it."""
        if name in self._generators:
            raise ValueError(f"generator {name!r} is already registered")
        self._generators[name] = (get, set)

    def capture(self) -> dict[str, Any]:
        return {name: get() for name, (get, _) in self._generators.items()}

    def restore(self, states: dict[str, Any]) -> None:
        for name, state in states.items():
            if name not in self._generators:
                raise KeyError(f"no generator registered under {name!r}")
            self._generators[name][1](state)


def capture_rng_state(extra: RngStateTracker | None = None) -> dict[str, Any]:
    """Snapshot of all generators (host-side copies; no device sync)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": None,
        "extra": extra.capture() if extra is not None else {},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], extra: RngStateTracker | None = None) -> None:
    """Restore a snapshot taken by :func:`capture_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    if extra is not None and state.get("extra"):
        extra.restore(state["extra"])


def portable_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """A :func:`capture_rng_state` snapshot another rank can adopt (to replay this rank's pass).

    The CUDA part keeps only this process's current device generator: a peer sets it on *its*
    current device (``get_rng_state_all`` lists every visible device, indexed by device, which
    differs between ranks). Tensors are CPU byte tensors already.
    """
    portable = {k: v for k, v in state.items() if k != "cuda"}
    cuda = state.get("cuda")
    portable["cuda_current"] = (
        cuda[torch.cuda.current_device()]
        if cuda is not None and torch.cuda.is_initialized()
        else None
    )
    return portable


def adopt_rng_state(state: dict[str, Any], extra: RngStateTracker | None = None) -> None:
    """Set every generator from another rank's :func:`portable_rng_state` (its CUDA generator
    state on this process's current device)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("cuda_current")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(cuda)
    if extra is not None and state.get("extra"):
        extra.restore(state["extra"])
