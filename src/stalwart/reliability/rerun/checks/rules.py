"""Validation rules, specs and records, and the host-side evaluation of rejections.

What a validation call checks (:class:`CheckSpec`, :class:`DeviceRule`), the record of one call
before its value is read (:class:`ValidationRecord`), and how a rejection or comparison function
is applied to a host value. The device buffer that holds the values is
:class:`stalwart.reliability.rerun.checks.buffer.ValidationBuffer`.

Rejection and comparison functions are called with host values. ``torch.isnan`` / ``torch.isinf``
are evaluated with :mod:`math`; callables marked with :func:`host_predicate` (such as
``RerunStateMachine.is_unexpectedly_large`` and ``compare_floats``) receive Python floats; any other
callable receives 0-d CPU float64 tensors (Megatron compatibility), never device tensors.
"""

from __future__ import annotations

import enum
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from stalwart.reliability.rerun.checks.stats import compare_floats
from stalwart.reliability.rerun.types import CallKey, CheckConfig

F = TypeVar("F", bound=Callable[..., Any])

NAN_LOSS_MESSAGE = "found NaN in local forward loss calculation"
INF_LOSS_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_LOSS_MESSAGE = "Spiky loss"
_GRAD_WHERE = "in backward pass before data-parallel communication collective"
NAN_GRAD_MESSAGE = f"found NaN in local grad norm {_GRAD_WHERE}"
INF_GRAD_MESSAGE = f"found Inf in local grad norm {_GRAD_WHERE}"
LARGE_GRAD_MESSAGE = f"found unexpected large grads {_GRAD_WHERE}"
GRAD_TOLERANCE = 1e-3


def is_grad_message(message: str) -> bool:
    """Whether ``message`` is one of the gradient checks' (per bucket, before the all-reduce)."""
    return _GRAD_WHERE in message


def grad_message(kind: str, bucket: int | None) -> str:
    """Megatron's gradient check message (``kind``: NaN, Inf or large), naming the bucket when
    there is more than one."""
    if kind == "large":
        where = _GRAD_WHERE if bucket is None else f"in bucket #{bucket} {_GRAD_WHERE}"
        return f"found unexpected large grads {where}"
    where = _GRAD_WHERE if bucket is None else f"for bucket #{bucket} {_GRAD_WHERE}"
    return f"found {kind} in local grad norm {where}"


DEFAULT_LARGE_SAMPLES = 100  # Megatron's sampling window of is_unexpectedly_large
# The value of a buffer slot not written in the current pass: -DBL_MAX, finite (so never a
# NaN/Inf verdict) and out of reach of any value converted from a float32/bfloat16 scalar. A
# marker in the values themselves instead of a flag per slot: a record is one device write.
UNWRITTEN = -sys.float_info.max


def host_predicate(func: F) -> F:
    """Mark a rejection or comparison function as taking Python floats instead of tensors."""
    func.accepts_host_float = True  # type: ignore[attr-defined]
    return func


host_predicate(compare_floats)


def _accepts_host(func: Callable[..., Any]) -> bool:
    if getattr(func, "accepts_host_float", False):
        return True
    inner = func.func if isinstance(func, functools.partial) else None
    return bool(inner is not None and getattr(inner, "accepts_host_float", False))


def evaluate_rejection(func: Callable[..., Any] | None, value: float) -> bool:
    """Apply a rejection function to a host value (never touches a device)."""
    if func is None:
        return False
    if func is torch.isnan:
        return math.isnan(value)
    if func is torch.isinf:
        return math.isinf(value)
    if _accepts_host(func):
        return bool(func(value))
    return bool(func(torch.tensor(value, dtype=torch.float64)))


def evaluate_comparison(func: Callable[..., Any], initial: float, rerun: float) -> float:
    """Apply a comparison function to two host values; NaN is treated as a mismatch."""
    if _accepts_host(func):
        out = float(func(initial, rerun))
    else:
        t = functools.partial(torch.tensor, dtype=torch.float64)
        out = float(func(t(initial), t(rerun)))
    return math.inf if math.isnan(out) else out


class RuleKind(enum.Enum):
    """A rejection the device can evaluate."""

    NAN = "nan"
    INF = "inf"
    LARGE = "large"  # |v| >= threshold x the max of the first num_samples values of a context


@dataclass(frozen=True)
class DeviceRule:
    """A device-evaluated rejection (see :class:`RuleKind`)."""

    kind: RuleKind
    context: str = ""
    threshold: float = 0.0
    num_samples: int = DEFAULT_LARGE_SAMPLES


NAN_RULE = DeviceRule(RuleKind.NAN)
INF_RULE = DeviceRule(RuleKind.INF)


@dataclass(frozen=True)
class DeviceCheck:
    """One device check of a value: its rule, message, rerun tolerance and fatality."""

    rule: DeviceRule
    message: str
    tolerance: float = 0.0
    fatal: bool = True


def device_rule_of(func: Callable[..., Any] | None) -> DeviceRule | None:
    """The device rule equal to a Megatron-style rejection function, or None (host only).

    ``torch.isnan``, ``torch.isinf`` and ``functools.partial(sm.is_unexpectedly_large,
    threshold=..., context=...)`` (without ``resample``) have device equivalents.
    """
    if func is torch.isnan:
        return NAN_RULE
    if func is torch.isinf:
        return INF_RULE
    if isinstance(func, functools.partial) and getattr(func.func, "__name__", "") == (
        "is_unexpectedly_large"
    ):
        kw = func.keywords
        if "threshold" in kw and "context" in kw and not kw.get("resample", False):
            samples = int(kw.get("num_samples", DEFAULT_LARGE_SAMPLES))
            return DeviceRule(RuleKind.LARGE, str(kw["context"]), float(kw["threshold"]), samples)
    return None


@dataclass(frozen=True)
class CheckSpec:
    """What a validation call checks and how a rerun is compared with the initial run."""

    message: str
    rejection_func: Callable[..., Any] | None
    comparison_func: Callable[..., Any] = compare_floats
    tolerance: float = 0.0
    fatal: bool = True


@dataclass
class ValidationRecord:
    """One validation call of the current run, before its value is read.

    ``rejected`` is the device's verdict for buffer slots (None: evaluate ``spec`` on the host).
    """

    key: CallKey
    spec: CheckSpec
    value: torch.Tensor | float
    injected: bool = False
    rejected: bool | None = None


def is_rejected(record: ValidationRecord, value: float) -> bool:
    """The record's verdict: the device's when it has one, else the host rejection function."""
    if record.injected:
        return True
    if record.rejected is not None:
        return record.rejected
    return evaluate_rejection(record.spec.rejection_func, value)


def as_scalar(result: torch.Tensor | float) -> torch.Tensor | float:
    """Detached float64 0-d copy of a one-element tensor (device op only), or a Python float."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ValueError(f"validation results must be scalars; got shape {tuple(result.shape)}")
        return result.detach().reshape(()).to(torch.float64, copy=True)
    return float(result)


def loss_checks(checks: CheckConfig) -> tuple[DeviceCheck, ...]:
    """The device checks of one local loss that ``checks`` asks for, in Megatron's order."""
    out = []
    if checks.nan_and_inf:
        out += [DeviceCheck(NAN_RULE, NAN_LOSS_MESSAGE), DeviceCheck(INF_RULE, INF_LOSS_MESSAGE)]
    if checks.spiky_loss:
        rule = DeviceRule(RuleKind.LARGE, "loss", checks.spiky_loss_factor, checks.large_samples)
        out.append(DeviceCheck(rule, SPIKY_LOSS_MESSAGE, fatal=False))
    return tuple(out)


def grad_checks(checks: CheckConfig, bucket: int | None) -> tuple[DeviceCheck, ...]:
    """The device checks of one local grad norm (of ``bucket``) that ``checks`` asks for."""
    out = []
    if checks.nan_and_inf:
        out += [
            DeviceCheck(NAN_RULE, grad_message("NaN", bucket), GRAD_TOLERANCE),
            DeviceCheck(INF_RULE, grad_message("Inf", bucket), GRAD_TOLERANCE),
        ]
    if checks.large_grads:
        rule = DeviceRule(RuleKind.LARGE, "grads", checks.large_grads_factor, checks.large_samples)
        out.append(DeviceCheck(rule, grad_message("large", bucket), GRAD_TOLERANCE, fatal=False))
    return tuple(out)
