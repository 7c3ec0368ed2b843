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
