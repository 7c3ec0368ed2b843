"""Capture and restore every random generator a training step may consume (a leaf module: any
component may import it; it imports nothing of stalwart's).

Covers Python ``random``, NumPy's legacy global generator, the torch CPU generator, every CUDA
device generator (only when CUDA is already initialised, so capturing never initialises CUDA) and
the extra named generators of an `ExtraGenerators` object (the rerun machine's
``RngStateTracker``, e.g. a tensor-parallel RNG tracker). Used by the rerun machine, the loop's
checkpointed RNG state and the FLOP count (which must leave every generator as it found it).

    >>> import random
    >>> state = capture_rng_state()
    >>> first = random.random()
    >>> restore_rng_state(state)
    >>> random.random() == first
    True
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import numpy as np
import torch


class ExtraGenerators(Protocol):
    """Named generators beyond the built-in ones: ``capture()`` returns their states by name,
    ``restore(states)`` sets them back."""

    def capture(self) -> dict[str, Any]: ...
    def restore(self, states: dict[str, Any]) -> None: ...


def capture_rng_state(extra: ExtraGenerators | None = None) -> dict[str, Any]:
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


def restore_rng_state(state: dict[str, Any], extra: ExtraGenerators | None = None) -> None:
    """Restore a snapshot taken by :func:`capture_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    if extra is not None and state.get("extra"):
        extra.restore(state["extra"])
