"""Two versions of stalwart in one benchmark process: the one on ``sys.path`` and another source
tree (e.g. ``git archive <commit> src | tar -x -C /tmp/base``), so a change is timed side by side
with what it replaced, in the same rounds (a shared machine's drift then cancels in the ratio).

Each :class:`SourceVersion` keeps its own ``stalwart`` modules: :meth:`SourceVersion.active`
puts them in ``sys.modules`` (and its tree first on ``sys.path``) for the duration, so what is
built or imported lazily inside belongs to that version. Objects built under one version keep
their classes and module globals when the other is active.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType


def _take_stalwart_modules() -> dict[str, ModuleType]:
    """Remove every ``stalwart`` module from ``sys.modules`` and return them."""
    names = [n for n in sys.modules if n == "stalwart" or n.startswith("stalwart.")]
    return {n: sys.modules.pop(n) for n in names}


class SourceVersion:
    """A stalwart source tree (``src``: its directory holding ``stalwart/``; None: the one that
    ``sys.path`` finds first)."""

    def __init__(self, src: str | None, label: str) -> None:
        self.src = src
        self.label = label
        self._modules: dict[str, ModuleType] | None = None if src else {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.src is None:  # the default: whatever is imported now
            yield
            return
        outer = _take_stalwart_modules()
        sys.modules.update(self._modules or {})
        sys.path.insert(0, self.src)
        try:
            yield
        finally:
            sys.path.remove(self.src)
            self._modules = _take_stalwart_modules()
            sys.modules.update(outer)
