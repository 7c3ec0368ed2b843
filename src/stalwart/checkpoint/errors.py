"""Checkpoint error type."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the path and what is wrong."""


class PeerLostError(CheckpointError):
    """A rank went away (its process died) during a checkpoint's agreement or commit. The
    message says which rank (when it can tell) and which checkpoint is kept on disk; the
    process should exit non-zero for its launcher to restart the job (``exit_code``)."""

    exit_code = 1
