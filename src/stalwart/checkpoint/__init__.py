"""Crash-safe checkpoints in Megatron's layout: DCP model/optimizer shards, async save,
non-persistent checkpoints, retention and an atomically advanced ``latest`` tracker. Nothing read
from a checkpoint runs code (`safe_state`, `dcp_safe`); one job per save directory (`lock`).

See :mod:`stalwart.checkpoint.manager` for the save/finalize/load protocol.
"""

from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.layout import (
    TRACKER_FILENAME,
    iteration_dir_name,
    list_complete_checkpoints,
    read_tracker,
    write_tracker_atomic,
)
from stalwart.checkpoint.manager import CheckpointManager, LoadedCheckpoint

__all__ = [
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "iteration_dir_name",
    "list_complete_checkpoints",
    "read_tracker",
    "write_tracker_atomic",
]
