"""`FixedPath`: an object's files of fixed names under its directory, as a table of read-only
attributes instead of one property each (a leaf: it imports nothing of stalwart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, overload


class FixedPath:
    """A read-only attribute: ``Path(<the instance's attribute root>, *parts)``, computed on each
    read (not a dataclass field); assigning to it raises ``AttributeError``, as for a property."""

    def __init__(self, root: str, *parts: str) -> None:
        self._root = root
        self._parts = parts

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> FixedPath: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Path: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Path | FixedPath:
        if obj is None:
            return self
        return Path(getattr(obj, self._root), *self._parts)

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(f"a path under {self._root!r} is fixed: it cannot be set")
