"""Convert checkpoints of an older stalwart (``common.pt``/``rank_*.pt`` pickles) to JSON state.

Those pickles can run code when read, so a resume refuses them. Whoever trusts the writer of a
checkpoint converts it once, explicitly (``stalwart checkpoints convert --trust-pickle PATH``):
the pickles are read with ``torch.load(weights_only=False)`` *here only*, re-encoded with
`stalwart.checkpoint.safe_state` (``common.json``, ``rank_XXXXX.json``, written atomically), the
DCP files are left as they are (they were never pickled state of ours; their ``.metadata`` is
read with the restricted unpickler), and the pickles are deleted last. A crash in between leaves
both forms; the JSON wins from then on and a rerun of the command finishes the job.

Example::

    converted = convert_path("/ckpt/run1", trust_pickle=True)   # every legacy iter_* under it
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any

from stalwart.atomic_file import fsync_dir, write_text_atomic
from stalwart.checkpoint import layout
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.safe_state import StateFormatError
from stalwart.regular_file import open_regular


def _legacy_dirs(path: str) -> list[str]:
    """``path`` itself when it is one checkpoint, else its legacy ``iter_*`` checkpoints (and
    those of its ``non_persistent`` tier)."""
    if layout.parse_iteration_dir_name(os.path.basename(os.path.normpath(path))) is not None:
        return [path] if os.path.isfile(os.path.join(path, layout.LEGACY_COMMON_FILENAME)) else []
    found = []
    for root in (path, os.path.join(path, layout.NON_PERSISTENT_SUBDIR)):
        for iteration in layout.list_complete_checkpoints(root):
            candidate = os.path.join(root, layout.iteration_dir_name(iteration))
            if os.path.isfile(os.path.join(candidate, layout.LEGACY_COMMON_FILENAME)):
                found.append(candidate)
    return found


def _trusted_load(path: str) -> Any:
    import torch

    # weights_only=False on purpose: the operator vouched for this file (--trust-pickle).
    return torch.load(path, map_location="cpu", weights_only=False)


def convert_checkpoint(path: str) -> None:
    """Rewrite one legacy checkpoint directory in place (see module docstring).

    Raises:
        CheckpointError: naming the file whose state cannot be stored as JSON.
    """
    pickles = [os.path.join(path, layout.LEGACY_COMMON_FILENAME)]
    pickles += sorted(glob.glob(os.path.join(path, "rank_[0-9]*.pt")))
    for source in pickles:
        if not os.path.isfile(source):
            raise CheckpointError(f"{source}: missing; {path} is not a complete legacy checkpoint")
    for source in pickles:
        target = source[: -len(".pt")] + ".json"
        try:
            layout.write_state_fsynced(_trusted_load(source), target)
        except StateFormatError as exc:
            raise CheckpointError(f"{source}: cannot convert: {exc}") from None
    _update_format(os.path.join(path, layout.METADATA_FILENAME))
    for source in pickles:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(source)
    fsync_dir(path)


def _update_format(metadata_path: str) -> None:
    from stalwart.checkpoint.commit import FORMAT_VERSION

    try:
        with open_regular(metadata_path) as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(facts, dict):
        facts["format"] = FORMAT_VERSION
        write_text_atomic(metadata_path, json.dumps(facts, indent=2) + "\n")


def convert_path(path: str, *, trust_pickle: bool) -> list[str]:
    """Convert the legacy checkpoint ``path`` or every legacy checkpoint under it.

    Returns:
        The converted directories (empty when there was nothing to convert).

    Raises:
        ValueError: ``trust_pickle`` is False (reading a pickle runs whatever it says), or
            ``path`` is not a directory.
        CheckpointError: a checkpoint could not be converted (named).
    """
    if not trust_pickle:
        raise ValueError(
            "--trust-pickle is required: converting reads common.pt/rank_*.pt with pickle, "
            "which runs any code they contain; pass it only for checkpoints you trust"
        )
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory")
    done = []
    for directory in _legacy_dirs(path):
        convert_checkpoint(directory)
        done.append(directory)
    return done
