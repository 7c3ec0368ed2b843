"""The rerun machine's generators: extra named ones (:class:`RngStateTracker`) and a snapshot
another rank can adopt. The capture and restore of every generator is the leaf module
`stalwart.rng_state`.
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
