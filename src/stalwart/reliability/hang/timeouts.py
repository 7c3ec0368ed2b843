"""Learned hang-detection timeouts (``--calc-ft-timeouts``): pure functions and ``ft_state.json``.

See the "Learned timeouts" section of :mod:`stalwart.reliability.hang.sections` for the rules.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from stalwart.reliability.hang.config import (
    _TIMEOUT_KEYS,
    FT_STATE_FILENAME,
    FT_STATE_VERSION,
    FaultToleranceConfig,
    SectionTimeouts,
)

logger = logging.getLogger(__name__)


def select_sections_to_update(
    *,
    closing: bool,
    num_timed_steps: int,
    num_checkpoints: int,
    persistent_checkpoint_loaded: bool,
    async_save: bool,
    min_steps: int = 16,
) -> frozenset[str]:
    """Which timeouts have enough evidence to be learned (Megatron's rules, see module doc)."""
    chosen: set[str] = set()
    if persistent_checkpoint_loaded:
        chosen.add("setup")  # in-memory/local loads are too fast to size a persistent load
    if num_timed_steps >= min_steps:
        chosen.add("step")
    if num_checkpoints >= 1 and not async_save:
        chosen.add("checkpointing")  # async saves only time the staging, not the write
    if closing and {"setup", "step"} <= chosen and num_checkpoints >= 1:
        chosen.add("out_of_section")
    return frozenset(chosen)


def learn_timeouts(
    previous: SectionTimeouts,
    observed_max: Mapping[str, float],
    *,
    previously_calculated: frozenset[str],
    safety_factor: float,
    blend_alpha: float = 0.5,
    floor_s: float = 0.0,
) -> tuple[SectionTimeouts, frozenset[str]]:
    """New timeouts from observed maxima (seconds); keys absent or <= 0 keep their previous value.

    ``new = max(floor_s, safety_factor * observed)``; a key learned before is blended as
    ``blend_alpha * previous + (1 - blend_alpha) * new``. Returns the timeouts and the set of
    learned keys.
    """
    updates: dict[str, float] = {}
    for key in _TIMEOUT_KEYS:
        seen = observed_max.get(key, -1.0)
        if seen <= 0:
            continue
        new = max(floor_s, safety_factor * seen)
        if key in previously_calculated:
            new = blend_alpha * getattr(previous, key) + (1.0 - blend_alpha) * new
        updates[key] = max(new, floor_s, 1e-3)
    return replace(previous, **updates), previously_calculated | frozenset(updates)


@dataclass(frozen=True)
class FtState:
    """Contents of ``<save>/ft_state.json``."""

    timeouts: SectionTimeouts
    calculated_sections: frozenset[str]
    observed_max_s: dict[str, float] = field(default_factory=dict)


def ft_state_path(save_dir: str | os.PathLike[str]) -> Path:
    return Path(save_dir) / FT_STATE_FILENAME


def save_ft_state(path: str | os.PathLike[str], state: FtState, safety_factor: float) -> None:
    """Write the state atomically (temp file, fsync, rename) so a crash never leaves half a file."""
    payload = {
        "version": FT_STATE_VERSION,
        "timeouts": state.timeouts.as_dict(),
        "calculated_sections": sorted(state.calculated_sections),
        "observed_max_s": state.observed_max_s,
        "safety_factor": safety_factor,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def load_ft_state(path: str | os.PathLike[str]) -> FtState | None:
    """Read ``ft_state.json``; None when absent. A corrupt file is logged and ignored."""
    target = Path(path)
    if not target.exists():
        return None
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
        timeouts = SectionTimeouts(**{k: float(data["timeouts"][k]) for k in _TIMEOUT_KEYS})
        calculated = frozenset(str(k) for k in data["calculated_sections"]) & frozenset(
            _TIMEOUT_KEYS
        )
        observed = {str(k): float(v) for k, v in data.get("observed_max_s", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("stalwart-ft: ignoring unreadable %s (%s)", target, exc)
        return None
    return FtState(timeouts, calculated, observed)


def resolve_timeouts(
    config: FaultToleranceConfig, save_dir: str | os.PathLike[str] | None
) -> tuple[SectionTimeouts, frozenset[str]]:
    """Configured timeouts, with the learned sections of ``<save>/ft_state.json`` substituted."""
    state = load_ft_state(ft_state_path(save_dir)) if save_dir is not None else None
    if state is None or not state.calculated_sections:
        return config.timeouts, frozenset()
    learned = {k: getattr(state.timeouts, k) for k in state.calculated_sections}
    return replace(config.timeouts, **learned), state.calculated_sections
