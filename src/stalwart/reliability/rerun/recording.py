"""How the rerun state machine records checks: host-evaluated records and device checks.

Split from ``machine.py`` to keep files small; mixed into ``RerunStateMachine``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from stalwart.reliability.rerun.buffer import (
    CheckSpec,
    DeviceRule,
    RuleKind,
    ValidationBuffer,
    ValidationRecord,
    as_scalar,
    host_predicate,
)
from stalwart.reliability.rerun.passes import Records
from stalwart.reliability.rerun.stats import LargeValueTracker, compare_floats, host_float
from stalwart.reliability.rerun.types import CallKey, CheckConfig, RerunMode, RerunState


class RecordingMixin:
    """Recording of validation calls; the machine provides the state used here."""

    mode: RerunMode
    state: RerunState
    checks: CheckConfig
    _records: Records
    _host_checks: bool
    _large: dict[str, LargeValueTracker]

    def check_buffer(self, device: torch.device) -> ValidationBuffer:
        raise NotImplementedError

    def _inject_decision(self, key: CallKey) -> bool:
        raise NotImplementedError

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
        if self._host_checks:  # evaluation: resolved on the host, the buffer stays untouched
            self.validate_result(value, self._host_rule(rule), message, None, tolerance, fatal)
            return
        self._require_pass()
        key = self._records.next_key("", message)
        spec = CheckSpec(message, self._host_rule(rule), compare_floats, tolerance, fatal)
        buffer = self.check_buffer(value.device)
        known = len(buffer.specs)
        slot = buffer.slot_for(key, spec, rule)
        if slot >= known and self._inject_decision(key):  # a new slot: decide its injection now
            buffer.inject[slot] = True
            buffer.inject_host[slot] = True
        buffer.record(slot, value)

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

        record_loss_checks(self, loss, self.checks)

    def check_grad_norm(self, norm: torch.Tensor, bucket: int | None = None) -> None:
        """Megatron's gradient checks of a local (pre-reduction) grad norm, of DDP bucket
        ``bucket`` when given, as :attr:`checks` says."""
        from stalwart.reliability.rerun.checks import record_grad_checks

        record_grad_checks(self, norm, self.checks, bucket)

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
