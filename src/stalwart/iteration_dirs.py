"""The names a checkpoint root uses for its iterations (a leaf: it imports nothing of stalwart
but ``regular_file``): the ``iter_0000010`` directory names and the tracker file holding the
latest one. ``stalwart.checkpoint.layout`` builds on them; the rerun verdict names the
checkpoint to resume with them without importing the checkpoint package."""

from __future__ import annotations

import os
import re

from stalwart.regular_file import open_regular

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"

_TRACKER_MAX_BYTES = 64
_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000010`` for 10 (Megatron's 7-digit zero pad; longer numbers keep every digit)."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> int | None:
    """Inverse of :func:`iteration_dir_name`; None for anything else (tmp dirs included)."""
    match = _ITER_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def tracker_iteration(root: str) -> int | None:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt``; None when the file is absent.

    Raises:
        ValueError: the file cannot be read (the ``OSError`` is its cause) or does not hold a
            non-negative integer (Megatron's ``release`` marker included).
    """
    path = os.path.join(root, TRACKER_FILENAME)
    try:
        with open_regular(path) as f:
            content = f.read(_TRACKER_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read checkpoint tracker {path}: {exc.strerror or exc}") from exc
    # ASCII digits only: str.isdigit() accepts '²' and other digits that int() then rejects.
    text = content.strip()
    if len(content) > _TRACKER_MAX_BYTES or not (text.isascii() and text.isdigit()):
        raise ValueError(
            f"checkpoint tracker {path} must hold a non-negative iteration integer, got "
            + _shown(content)
        )
    return int(text)


def _shown(content: bytes) -> str:
    """A damaged tracker's content for a one-line message."""
    if len(content) > _TRACKER_MAX_BYTES:
        return f"a file of more than {_TRACKER_MAX_BYTES} bytes"
    if not content.strip():
        return "an empty file" if not content else "only whitespace"
    text = content.strip()[:40]
    if text.isascii() and text.decode().isprintable():
        return repr(text.decode())
    return f"binary data {text!r}"
