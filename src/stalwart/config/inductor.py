"""``--inductor-config KEY=VALUE``: per-compile Inductor options for ``--compile``.

The model's ``torch.compile`` takes them as its ``options`` (nothing process-global changes).
Why a pass-through: what Inductor does best differs by shape and torch version, and the
measured case is issue 19's: at gpt2-124m on the H200 Inductor's *mix-order reduction* fuses
each LayerNorm backward's row and column reductions into one kernel that leaves fp32 partial
sums, finished by an eager ``sum(dim=0)`` per weight and bias (200 aten reduce kernels per
iteration, 2.1 ms); ``triton.mix_order_reduction=False`` or a larger
``triton.mix_order_reduction_split_size`` trade that against the fused kernel.

Values are Python literals (``ast.literal_eval``: nothing is executed) of the option's own type;
the key must be an Inductor option of the running torch. Bad input raises ``ValueError`` naming
the flag.

    >>> parse_inductor_options(["triton.mix_order_reduction=False", "max_autotune=True"])
    {'triton.mix_order_reduction': False, 'max_autotune': True}
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

FLAG = "--inductor-config"
# Options the trainer sets itself (Inductor's CUDA graphs cannot nest inside a full-iteration one).
_RESERVED = frozenset({"triton.cudagraphs"})
_LITERALS = (bool, int, float, str, type(None))


def known_inductor_options() -> dict[str, Any]:
    """The running torch's Inductor options and their current values."""
    import torch._inductor.config as inductor_config

    return inductor_config.get_config_copy()


def _none_allowed(key: str, current: Any) -> bool:
    """Whether the option takes None: its declared type (torch's config entry, where this torch
    records it) says Optional; without a declared type, every option but a bool one (a None
    reached torch.compile and failed there, a traceback after the model was built)."""
    import typing

    import torch._inductor.config as inductor_config

    entry = getattr(inductor_config, "_config", {}).get(key)
    declared = getattr(entry, "value_type", None)
    if declared is None:
        return not isinstance(current, bool)
    if declared is Any or declared is object:
        return True
    return type(None) in typing.get_args(declared)


def _value(key: str, text: str, current: Any) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"{FLAG} {key}={text!r}: the value must be a Python literal (True, 64, 0.5, 'x')"
        ) from None
    if not isinstance(value, _LITERALS):
        raise ValueError(f"{FLAG} {key}: only bool, int, float, str or None values, got {text!r}")
    if current is None:
        return value
    if value is None:
        if _none_allowed(key, current):
            return value
        kind = "True or False" if isinstance(current, bool) else f"a {type(current).__name__}"
        raise ValueError(f"{FLAG} {key}: Inductor's option takes {kind} (not None), got {text!r}")
    if isinstance(current, bool) or isinstance(value, bool):
        if isinstance(current, bool) and isinstance(value, bool):
            return value
    elif isinstance(current, float) and isinstance(value, int | float):
        return float(value)
    elif isinstance(value, type(current)):
        return value
    raise ValueError(
        f"{FLAG} {key}: Inductor's option is a {type(current).__name__} "
        f"(now {current!r}), got {text!r}"
    )


def parse_inductor_options(items: Iterable[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a ``torch.compile(options=...)`` dict (checked; see module)."""
    options: dict[str, Any] = {}
    if not items:
        return options
    known = known_inductor_options()
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"{FLAG} takes KEY=VALUE (e.g. triton.mix_order_reduction=False), got {item!r}"
            )
        if key in _RESERVED:
            raise ValueError(f"{FLAG} {key}: set by stalwart itself (not allowed)")
        if key not in known:
            raise ValueError(
                f"{FLAG} {key}: not an Inductor option of this torch (see "
                "torch._inductor.config; e.g. triton.mix_order_reduction, max_autotune)"
            )
        if key in options:
            raise ValueError(f"{FLAG} {key}: given twice")
        options[key] = _value(key, text.strip(), known[key])
    return options


__all__ = ["known_inductor_options", "parse_inductor_options"]
