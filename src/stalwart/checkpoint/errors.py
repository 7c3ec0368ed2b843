"""Checkpoint error type."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the path and what is wrong."""
