"""Checkpoint comparisons for chaos runs: bitwise parameters and readability of the whole chain.

Both read a checkpoint directory without building the model: every tensor of the DCP state
(model and optimizer) is loaded into CPU memory in this process (no process group), plus the
``common.json`` and every ``rank_*.json`` file. A checkpoint is "readable" when all of that loads.
Everything is read the way a resume reads it (`stalwart.checkpoint.dcp_safe`,
`stalwart.checkpoint.safe_state`): a planted pickle cannot run here either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint import layout
from stalwart.checkpoint.dcp_io import MODEL_KEY
from stalwart.checkpoint.safe_state import read_state_file


def load_dcp_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint directory, nested as saved (``{"model": ..., "optim":
    ...}``)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from stalwart.checkpoint.dcp_readers import (
        SafeEmptyStateDictLoadPlanner,
        SafeFileSystemReader,
    )

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=SafeFileSystemReader(str(path)),
        planner=SafeEmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


def check_readable(path: str | os.PathLike[str]) -> str | None:
    """None when the checkpoint directory loads completely, else the problem (naming the path)."""
    path = Path(path)
    problem = layout.check_files(str(path))
    if problem is not None:
        return f"{path}: {problem}"
    try:
        load_dcp_state(path)
        read_state_file(str(path / layout.COMMON_FILENAME))
        rank_files = sorted(path.glob("rank_*.json"))
        if not rank_files:
            return f"{path}: no rank_*.json file"
        for rank_file in rank_files:
            read_state_file(str(rank_file))
    except Exception as exc:  # any failure to read is the finding
        return f"{path}: unreadable: {type(exc).__name__}: {exc}"
    return None


def chain_problems(save_dir: str | os.PathLike[str]) -> list[str]:
    """Problems of every complete checkpoint (persistent and non-persistent) and of the tracker.

    The tracker must name a complete checkpoint; every ``iter_N`` directory with a ``COMPLETE``
    marker must be readable. Partial (``.tmp-``) directories are never loaded, so not checked.
    """
    problems: list[str] = []
    for root in (Path(save_dir), Path(save_dir) / layout.NON_PERSISTENT_SUBDIR):
        if not root.is_dir():
            continue
        try:
            tracked = layout.read_tracker(str(root))
        except Exception as exc:
            problems.append(f"{root}: tracker unreadable: {exc}")
            tracked = None
        complete = layout.list_complete_checkpoints(str(root))
        if tracked is not None and tracked not in complete:
            problems.append(f"{root}: tracker names {tracked}, not a complete checkpoint")
        for it in complete:
            problem = check_readable(root / layout.iteration_dir_name(it))
            if problem is not None:
                problems.append(problem)
    return problems


def params_equal(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether the model parameters of two checkpoint directories are bitwise equal, and why not."""
    left, right = load_dcp_state(a)[MODEL_KEY], load_dcp_state(b)[MODEL_KEY]
    if left.keys() != right.keys():
        return False, f"parameter names differ: {sorted(set(left) ^ set(right))[:5]}"
    for key in left:
        x, y = left[key], right[key]
        if isinstance(x, torch.Tensor) and not torch.equal(x, y):
            return False, f"parameter {key} differs"
    return True, ""
