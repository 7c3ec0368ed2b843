"""How the rerun state machine records checks: host-evaluated records and device checks.

Split from ``machine.py`` to keep files small; mixed into ``RerunStateMachine``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stalwart.reliability.rerun.buffer import (
    CheckSpec,
    DeviceCheck,
    DeviceRule,
    RuleKind,
    ValidationBuffer,
    ValidationRecord,
    as_scalar,
    host_predicate,
)
from stalwart.reliability.rerun.core import MachineCore
from stalwart.reliability.rerun.stats import LargeValueTracker, compare_floats, host_float
from stalwart.reliability.rerun.types import CallKey, RerunMode, RerunState


class RecordingMixin(MachineCore):
    """Recording of validation calls (a part of the machine: ``core.MachineCore``)."""

    def validate_result(
        self,
        result: torch.Tensor | float,
        rejection_func: Callable[..., Any] | None,
        message: str,
        comparison_func: Callable[..., Any] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Record a check of a scalar ``result``, evaluated on the host at the next read.

        ``rejection_func(value) -> bool`` says the result is unexpected; ``comparison_func(a, b)``
        (default :func:`compare_floats`) measures how far a rerun's value is from the initial one;
        the result is reproducible when that is ``<= tolerance``. Non-fatal checks never stop the
        job. Must be called between ``should_run_forward_backward`` calls unless disabled. Prefer
        :meth:`check_on_device` (or :meth:`check_loss`) for NaN/Inf/large checks: their verdict
        is taken on the device, which lets a loop gate the optimizer step there.
        """
        self._require_pass()
        spec = CheckSpec(
            message, rejection_func, comparison_func or compare_floats, tolerance, fatal
        )
        key = self._records.next_key("", message)
        value = as_scalar(result)
        injected = self._inject_decision(key)
        if injected:
            value = (
                torch.full_like(value, math.nan) if isinstance(value, torch.Tensor) else math.nan
            )
        self._records.pending.append(ValidationRecord(key, spec, value, injected))

    def check_on_device(
        self,
        value: torch.Tensor,
        rule: DeviceRule,
        message: str,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Record a check whose verdict the device computes (:class:`DeviceRule`), into the
        machine's buffer: device ops only, graph-capturable, never a sync."""
        self.check_all_on_device(value, [[DeviceCheck(rule, message, tolerance, fatal)]])

    def check_all_on_device(
        self, values: torch.Tensor, checks: Sequence[Sequence[DeviceCheck]]
    ) -> None:
        """Record ``checks[i]`` of element ``i`` of ``values`` (0-d or 1-d), in that order, as
        :meth:`check_on_device` calls would: the same slots and verdicts, but one device op
        for all of them (a write of the values) once their slots are allocated, whatever the
        number of checks. Device ops only, never a sync."""
        if values.requires_grad:
            values = values.detach()
        if self._host_checks:  # evaluation: resolved on the host, the buffer stays untouched
            flat = values.reshape(-1)
            for i, row in enumerate(checks):
                for c in row:
                    rule = self._host_rule(c.rule)
                    self.validate_result(flat[i], rule, c.message, None, c.tolerance, c.fatal)
            return
        self._require_pass()
        buffer = self.check_buffer(values.device)
        next_key = self._records.next_key
        pairs = [(i, c) for i, row in enumerate(checks) for c in row]
        slots = [self._slot(buffer, next_key("", c.message), c) for _, c in pairs]
        if not slots:
            return
        width, start = len(checks[0]), slots[0]
        if slots == list(range(start, start + len(slots))) and all(len(r) == width for r in checks):
            buffer.record_run(start, width, values)  # contiguous: allocated in this order
            return
        flat = values.reshape(-1)
        for (i, _), slot in zip(pairs, slots, strict=True):  # another layout (rare): one by one
            buffer.record(slot, flat[i])

    def _slot(self, buffer: ValidationBuffer, key: CallKey, check: DeviceCheck) -> int:
        """The buffer slot of ``key``; a new one decides its error injection now."""
        slot = buffer.slot_index(key)
        if slot is not None:
            return slot
        rule = check.rule
        spec = CheckSpec(
            check.message, self._host_rule(rule), compare_floats, check.tolerance, check.fatal
        )
        slot = buffer.slot_for(key, spec, rule)
        if self._inject_decision(key):
            buffer.inject[slot] = True
            buffer.may_inject = True
            buffer.inject_host[slot] = True
        return slot

    def _host_rule(self, rule: DeviceRule) -> Callable[..., Any]:
        if rule.kind is RuleKind.NAN:
            return torch.isnan
        if rule.kind is RuleKind.INF:
            return torch.isinf
        return functools.partial(
            self.is_unexpectedly_large,
            threshold=rule.threshold,
            context=rule.context,
            num_samples=rule.num_samples,
        )

    def check_loss(self, loss: torch.Tensor) -> None:
        """Megatron's loss checks of one micro-batch's local loss, as :attr:`checks` says."""
        from stalwart.reliability.rerun.checks import record_loss_checks

        record_loss_checks(self, loss, self.checks, self._check_rows)

    def check_grad_norm(self, norm: torch.Tensor, bucket: int | None = None) -> None:
        """Megatron's gradient checks of a local (pre-reduction) grad norm, of DDP bucket
        ``bucket`` when given, as :attr:`checks` says."""
        from stalwart.reliability.rerun.checks import record_grad_checks

        record_grad_checks(self, norm, self.checks, bucket, self._check_rows)

    def _require_pass(self) -> None:
        if self.mode is not RerunMode.DISABLED and self.state is RerunState.NOT_RUNNING_YET:
            raise RuntimeError(
                "validate_result called outside the forward-backward pass; "
                "wrap evaluation in `with rerun_state_machine.disabled():`"
            )

    @host_predicate
    def is_unexpectedly_large(
        self,
        result: torch.Tensor | float,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """True when ``|result| >= threshold * max`` of the first ``num_samples`` values of ``context``.

        Meant as a rejection function (``functools.partial(sm.is_unexpectedly_large, threshold=10,
        context="loss")``): the machine then calls it with host floats at its sync point. Called
        directly with a device tensor it reads it (a sync). NaN/Inf return False. ``resample``
        restarts the sampling window.
        """
        tracker = self._large.setdefault(context, LargeValueTracker())
        if resample:
            tracker.count, tracker.max_value = 0, 0.0
        return tracker.check(host_float(result), threshold, context, num_samples)
