"""Adapters for the frameworks people train with, and the framework-neutral pieces they share.

* ``stalwart.integrations.lightning``: a Lightning 2.x callback (hang sections, the agreed
  exit with a save through Lightning's checkpointing, the training log and its probes, goodput)
  and a ``GuardedModule`` mixin for the rerun state machine (``pip install 'stalwart[lightning]'``).
* ``stalwart.integrations.hf``: a Hugging Face ``TrainerCallback`` mapping stalwart's decisions
  onto ``control.should_save`` / ``should_training_stop``, and a ``Trainer`` subclass for the rerun
  state machine (``pip install 'stalwart[hf]'``).
* :mod:`stalwart.integrations.framework_step`: the guarded step fed by a framework's batches,
  built on the same :class:`stalwart.loop.Shell` as the reference trainer and any loop.

Importing this package (or ``stalwart``) imports neither framework; each adapter imports its own
when it is imported, with one line naming the extra to install when it is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """``import module``, or ImportError with one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}: pip install 'stalwart[{extra}]' ({exc})"
        ) from None
