"""Learned hang-detection timeouts (``--calc-ft-timeouts``): pure functions and ``ft_state.json``.

See the "Learned timeouts" section of :mod:`stalwart.reliability.hang.sections` for the rules.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.regular_file import open_regular
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
    # Learned at every save once there is evidence, not only at shutdown (a quirk kept from
    # the fault-tolerance design: a job killed before its end never learned it).
    if {"setup", "step"} <= chosen and num_checkpoints >= 1:
        chosen.add("out_of_section")
    return frozenset(chosen)


# A learned (or loaded) timeout above this is absurd: it would switch hang detection off.
MAX_LEARNED_TIMEOUT_S = 24 * 3600.0


def timeout_problem(value: object, floor_s: float) -> str | None:
    """Why ``value`` cannot be a learned timeout (None: it can). One rule for learned and loaded."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"not a number: {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"{value!r} is not a finite number > 0"
    if value < floor_s:
        return f"{value:g} s is below the {floor_s:g} s floor of learned timeouts"
    if value > MAX_LEARNED_TIMEOUT_S:
        return f"{value:g} s is above the {MAX_LEARNED_TIMEOUT_S:g} s ceiling"
    return None


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
    ``blend_alpha * previous + (1 - blend_alpha) * new``; the result is kept within
    ``[floor_s, MAX_LEARNED_TIMEOUT_S]`` (`timeout_problem` is then None for it). Returns the
    timeouts and the set of learned keys.
    """
    updates: dict[str, float] = {}
    for key in _TIMEOUT_KEYS:
        seen = observed_max.get(key, -1.0)
        if not (math.isfinite(seen) and seen > 0):
            continue
        new = max(floor_s, safety_factor * seen)
        if key in previously_calculated:
            new = blend_alpha * getattr(previous, key) + (1.0 - blend_alpha) * new
        updates[key] = min(max(new, floor_s, 1e-3), MAX_LEARNED_TIMEOUT_S)
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
    write_text_atomic(target, json.dumps(payload, indent=2, sort_keys=True), sync=Sync.FILE)


def _read_ft_state(target: Path) -> tuple[dict[str, object], frozenset[str], dict[str, float]]:
    """Raw ``(timeouts, calculated sections, observed maxima)``; raises on a malformed file."""
    with open_regular(target) as f:  # a FIFO planted there would block the start
        data = json.loads(f.read(1 << 20).decode("utf-8"))
    raw = data["timeouts"]
    if not isinstance(raw, dict) or not isinstance(data["calculated_sections"], list):
        raise TypeError("'timeouts' must be an object and 'calculated_sections' a list")
    timeouts = {k: raw.get(k) for k in _TIMEOUT_KEYS}
    calculated = frozenset(str(k) for k in data["calculated_sections"]) & frozenset(_TIMEOUT_KEYS)
    observed = {str(k): float(v) for k, v in data.get("observed_max_s", {}).items()}
    return timeouts, calculated, observed


def load_ft_state(path: str | os.PathLike[str]) -> FtState | None:
    """Read ``ft_state.json``; None when absent. A corrupt file is logged and ignored.

    Values that are not finite numbers > 0 keep the built-in default and are not counted as
    learned; `resolve_timeouts` applies the floor and ceiling of learned timeouts on top.
    """
    target = Path(path)
    if not target.exists():
        return None
    try:
        raw, calculated, observed = _read_ft_state(target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        logger.warning("stalwart-ft: ignoring unreadable %s (%s)", target, exc)
        return None
    usable = {
        k: float(v)  # type: ignore[arg-type]  # timeout_problem: a finite number > 0
        for k, v in raw.items()
        if timeout_problem(v, 0.0) is None
    }
    timeouts = replace(SectionTimeouts(), **usable)
    return FtState(timeouts, calculated & frozenset(usable), observed)


def resolve_timeouts(
    config: FaultToleranceConfig, save_dir: str | os.PathLike[str] | None
) -> tuple[SectionTimeouts, frozenset[str]]:
    """Configured timeouts, with the learned sections of ``<save>/ft_state.json`` substituted.

    A learned value is used only if it passes the checks of a freshly learned one
    (`timeout_problem`: finite, > 0, >= ``min_learned_timeout_s``, <= ``MAX_LEARNED_TIMEOUT_S``);
    the rejected ones are named in one log line with the configured timeouts used instead. A
    file that cannot be read at all is ignored (one line).
    """
    if save_dir is None:
        return config.timeouts, frozenset()
    path = ft_state_path(save_dir)
    if not path.exists():
        return config.timeouts, frozenset()
    try:
        raw, calculated, _ = _read_ft_state(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        logger.warning("stalwart-ft: ignoring unreadable %s (%s)", path, exc)
        return config.timeouts, frozenset()
    learned: dict[str, float] = {}
    rejected: list[str] = []
    for key in sorted(calculated):
        problem = timeout_problem(raw[key], config.min_learned_timeout_s)
        if problem is None:
            learned[key] = float(raw[key])  # type: ignore[arg-type]
        else:
            rejected.append(f"{key} ({problem}; using {getattr(config.timeouts, key):g} s)")
    if rejected:
        logger.warning(
            "stalwart-ft: rejected learned timeouts in %s: %s", path, ", ".join(rejected)
        )
    return replace(config.timeouts, **learned), frozenset(learned)
