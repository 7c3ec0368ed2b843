"""Turning the straggler detector on and off while the job runs (Megatron's runtime toggle).

Megatron's rank 0 listens on ``--straggler-ctrlr-port`` and flips the detector at the next log
step after any connection. stalwart takes the request as a file instead: ``touch <run
dir>/straggler.toggle`` (no port open on the node, works through any shared file system or
``kubectl exec``). At each report rank 0 consumes the file and its request travels in the
report's one ``all_gather``, so every rank flips at the same log step::

    toggle = FileToggle(run_dir / TOGGLE_FILE, rank=0)
    toggle.requested()      # False
    (run_dir / TOGGLE_FILE).touch()
    toggle.requested()      # True, and the file is gone: one request, one flip
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TOGGLE_FILE = "straggler.toggle"


class FileToggle:
    """Rank 0's check for a toggle request (other ranks never look: they learn it from rank 0)."""

    def __init__(self, path: str | os.PathLike[str] | None, rank: int) -> None:
        self.path = Path(path) if path is not None else None
        self.rank = rank

    def requested(self) -> bool:
        """Whether a request is waiting; consumes it. Never raises (a file that cannot be
        removed is left, with one warning, and counts as no request)."""
        if self.rank != 0 or self.path is None or not self.path.exists():
            return False
        try:
            self.path.unlink()
        except OSError as exc:
            logger.warning("straggler: cannot remove %s (%s); toggle ignored", self.path, exc)
            return False
        return True
