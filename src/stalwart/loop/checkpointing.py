"""Checkpoint state registered, not packed by hand: ``Stateful`` parts saved and loaded in one call.

Usage (the trainer registers the same parts)::

    state = LoopState()                               # iteration counter (+ your own fields)
    ckpt = Checkpointer(CheckpointManager(save_dir), model, optimizer,
                        common={"loop": state, "step": step, "data": data},
                        per_rank={"rng": RngState(), "rerun": machine})
    ckpt.load()                                       # every part restored (None: fresh start)
    ...
    ckpt.save(state.iteration)                        # every part's state_dict, one checkpoint

``common`` parts are written once (rank 0's values; they survive a change of world size);
``per_rank`` parts per rank (skipped with a warning on load when the world size changed).
Parts are saved in registration order, common first: register the :class:`GuardedStep` before
the data and RNG so that its ``state_dict`` settles a look-ahead launch before they are read.
State values are JSON-friendly (numbers, strings, lists, dicts) plus tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from stalwart.checkpoint import CheckpointError, CheckpointManager, LoadedCheckpoint
from stalwart.rng_state import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict(state)`` (torchtitan's contract).

    A part may also define ``after_load(checkpoint_path)``: :meth:`Checkpointer.load` calls it
    once every part is restored (the rerun machine applies ``rerun_verdict.json`` there)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class LoopState:
    """A loop's progress: ``iteration`` = completed iterations (the next one's 0-based index)."""

    iteration: int = 0
    consumed_samples: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state.get("consumed_samples", 0))


class RngState:
    """Every generator's state (Python, NumPy, torch CPU and CUDA, registered extras) as a
    JSON-friendly dict with tensors."""

    def __init__(self, extra: Any = None) -> None:
        self.extra = extra

    def state_dict(self) -> dict[str, Any]:
        raw = capture_rng_state(self.extra)
        version, internal, gauss = raw["python"]
        kind, keys, pos, has_gauss, cached = raw["numpy"]
        return {
            "python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "torch_cpu": raw["torch_cpu"],
            "cuda": list(raw["cuda"]) if raw["cuda"] is not None else None,
            "extra": raw["extra"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        keys = np.asarray(keys.cpu().numpy() if isinstance(keys, torch.Tensor) else keys)
        raw = {
            "python": (int(version), tuple(int(x) for x in internal), gauss),
            "numpy": (kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)),
            "torch_cpu": state["torch_cpu"],
            "cuda": state.get("cuda"),
            "extra": state.get("extra") or {},
        }
        restore_rng_state(raw, self.extra)


def _load_part(path: str, name: str, part: Stateful, state: Any) -> None:
    """``part.load_state_dict(state)``; a state of another shape is one line naming the part."""
    try:
        part.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its {name!r} state is not what this loop saves "
            f"({type(exc).__name__}: {exc})"
        ) from None


class Checkpointer:
    """Saves and loads a model, its optimizer and registered :class:`Stateful` parts.

    Args:
        manager: the :class:`stalwart.checkpoint.CheckpointManager` (layout, atomic commits).
        model / optimizer: saved as DCP shards.
        common / per_rank: the parts, by name (see the module docstring).
        upgrade_common: maps the common dict of an older layout (other part names) to this
            one, before the parts load; the result is ``LoadedCheckpoint.common``.
        check_common: called with the checkpoint's common dict before any tensor is read
            (e.g. refuse a checkpoint of another model shape with a ``ValueError``).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        common: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful] | None = None,
        check_common: Callable[[dict[str, Any]], None] | None = None,
        upgrade_common: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.manager = manager
        self.model = model
        self.optimizer = optimizer
        self.common = dict(common)
        self.per_rank = dict(per_rank or {})
        self.check_common = check_common
        self.upgrade_common = upgrade_common

    def save(self, iteration: int, *, non_persistent: bool = False) -> None:
        """One checkpoint of ``iteration`` with every part (collective: every rank calls it)."""
        common = {name: part.state_dict() for name, part in self.common.items()}
        per_rank = {name: part.state_dict() for name, part in self.per_rank.items()}
        self.manager.save(
            iteration, self.model, self.optimizer, common, per_rank, non_persistent=non_persistent
        )

    def load(
        self,
        *,
        load_optim: bool = True,
        skip: frozenset[str] = frozenset(),
        iteration: int | None = None,
    ) -> LoadedCheckpoint | None:
        """Restore the newest checkpoint into the model, optimizer and every part not in
        ``skip`` (e.g. ``{"rng"}`` for ``--no-load-rng``), then call each such part's
        ``after_load(path)`` if it has one (the rerun machine's raises ``SuspectDeviceError``
        on a device ``rerun_verdict.json`` names). None when there is none."""
        loaded = self.manager.load(
            self.model,
            self.optimizer,
            load_optim=load_optim,
            iteration=iteration,
            check_common=self.check_common,
        )
        if loaded is None:
            return None
        if self.upgrade_common is not None:
            loaded = replace(loaded, common=self.upgrade_common(dict(loaded.common)))
        for name, part in self.common.items():
            if name in skip:
                continue
            if name not in loaded.common:
                # Resuming without it would silently restart that state (e.g. at iteration 0).
                saved = ", ".join(sorted(loaded.common)) or "none"
                raise CheckpointError(
                    f"checkpoint {loaded.path} has no {name!r} state (it holds: {saved}); "
                    "it was saved by another loop or layout"
                )
            _load_part(loaded.path, name, part, loaded.common[name])
        per_rank = loaded.per_rank
        if per_rank is None and self.per_rank:
            logger.warning(
                "world size changed: %s not restored for this rank", ", ".join(self.per_rank)
            )
        elif per_rank is not None:
            for name, part in self.per_rank.items():
                if name not in skip and name in per_rank:
                    _load_part(loaded.path, name, part, per_rank[name])
        for name, part in {**self.common, **self.per_rank}.items():
            after_load = getattr(part, "after_load", None)  # e.g. the rerun machine's verdict
            if name not in skip and callable(after_load):
                after_load(loaded.path)
        return loaded

    @property
    def async_save(self) -> bool:
        """Whether the manager's saves finish in the background."""
        return bool(getattr(self.manager, "async_save", False))

    def maybe_finalize(self) -> int | None:
        return self.manager.maybe_finalize()

    def finalize(self) -> None:
        self.manager.finalize()

    def close(self, *, abort: bool = False) -> None:
        self.manager.close(abort=abort)


__all__ = ["Checkpointer", "LoopState", "RngState", "Stateful"]
