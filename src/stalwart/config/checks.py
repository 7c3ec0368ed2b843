"""Field checks every config dataclass runs: the value's type, finiteness and declared range.

A config calls ``check_fields(self)`` in ``__post_init__``. Each field is checked against its
annotation (``bool`` takes only True/False, ``int`` no bools or floats, ``float`` only finite
numbers, ``X | None`` also None, ``list[int]`` a list of ints) and against the bounds in its
metadata (``field(default=..., metadata=bounds(gt=0, le=10))``). The ``ValueError`` names the flag
(``--lr``; ``metadata=bounds(flag="--no-shuffle")`` where the flag is not ``--<field-name>``) and
what is allowed. Checks that relate several fields stay in the config's own ``__post_init__``.

Example::

    @dataclass(kw_only=True)
    class MyConfig:
        lr: float = field(default=1e-3, metadata=bounds(gt=0))

        def __post_init__(self) -> None:
            check_fields(self)

    MyConfig(lr=float("inf"))  # ValueError: --lr must be a finite number (got inf)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, Union

# Every integer flag is a count, size, interval, iteration or rank: 2**53 is the largest integer a
# float holds exactly (beyond it, LR schedules and throughput figures lose meaning).
INT_MAX = 2**53
SEED_MAX = 2**32 - 1  # numpy's legacy seeding takes [0, 2**32 - 1]


def bounds(
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    flag: str | None = None,
) -> dict[str, Any]:
    """Field metadata: the allowed range (open ``gt``/``lt``, closed ``ge``/``le``) and the flag."""
    meta = {"gt": gt, "ge": ge, "lt": lt, "le": le, "flag": flag}
    return {"stalwart": {k: v for k, v in meta.items() if v is not None}}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _matches(value: object, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT_MAX
    if tp is float:
        return _is_number(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = value if isinstance(value, list | tuple) else None
        return items is not None and all(_matches(v, args[0]) for v in items) if args else True
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp)
    return True  # other annotations: the config checks them itself


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        unset = " or unset" if type(None) in typing.get_args(tp) else ""
        return " or ".join(parts) + unset
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of ({_describe(args[0])})" if args else "a list"
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    return names.get(tp, str(tp))


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _range_text(meta: dict[str, Any]) -> str:
    parts = []
    for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if key in meta:
            parts.append(f"{op} {_number(meta[key])}")
    return " and ".join(parts)


def _in_range(value: float, meta: dict[str, Any]) -> bool:
    return (
        ("gt" not in meta or value > meta["gt"])
        and ("ge" not in meta or value >= meta["ge"])
        and ("lt" not in meta or value < meta["lt"])
        and ("le" not in meta or value <= meta["le"])
    )


def flag_of(field: dataclasses.Field[Any]) -> str:
    """The flag that sets ``field``: its metadata's ``flag``, else ``--<name-with-dashes>``."""
    meta = field.metadata.get("stalwart", {})
    return str(meta.get("flag") or "--" + field.name.replace("_", "-"))


def check_fields(config: object) -> None:
    """Raise ``ValueError`` naming the flag of the first field whose value is not allowed."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        tp = hints.get(field.name)
        meta = field.metadata.get("stalwart", {})
        if tp is not None and not _matches(value, tp):
            raise ValueError(f"{flag_of(field)} must be {_describe(tp)} (got {value!r})")
        ranged = [
            v for v in (value if isinstance(value, list | tuple) else [value]) if v is not None
        ]
        if not any(k in meta for k in ("gt", "ge", "lt", "le")):
            continue
        if any(not _is_number(v) or not _in_range(float(v), meta) for v in ranged):
            raise ValueError(f"{flag_of(field)} must be {_range_text(meta)} (got {value!r})")
