"""The rerun machine's recorder: the checks of a pass, host-evaluated records and device checks.

A :class:`Recorder` owns what a pass records into: the host records of the pass being recorded
and of the pass the next read evaluates (the two differ while a pass begun ahead records), the
device check buffers, and the host large-value windows. It never syncs; :meth:`Recorder.read`
is the machine's one deliberate read per pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from stalwart.reliability.rerun.checks.buffer import ValidationBuffer
from stalwart.reliability.rerun.checks.reading import read_values
from stalwart.reliability.rerun.checks.rules import (
    CheckSpec,
    DeviceCheck,
    DeviceRule,
    RuleKind,
    ValidationRecord,
    as_scalar,
    grad_checks,
    host_predicate,
    loss_checks,
)
from stalwart.reliability.rerun.checks.stats import LargeValueTracker, compare_floats, host_float
from stalwart.reliability.rerun.injector import RerunErrorInjector
from stalwart.reliability.rerun.passes import Records
from stalwart.reliability.rerun.types import CallKey, CheckConfig
from stalwart.reliability.rerun.verdicts import Items


class Recorder:
    """Records the validation calls of each pass (see the module docstring).

    Args:
        injector: the machine's error injector (whether a buffer may inject at all).
        decide: whether to corrupt the call ``key`` now (the machine's injection decision,
            asked once per new call).
        in_pass: whether a pass is running (a record outside one is refused).
        checks: which loss and gradient checks :meth:`check_loss`, :meth:`check_losses`,
            :meth:`check_grad_norm` and :meth:`check_grad_norms` record (Megatron's
            ``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss``,
            ``--check-for-large-grads`` and their factors).
    """

    def __init__(
        self,
        injector: RerunErrorInjector,
        decide: Callable[[CallKey], bool],
        in_pass: Callable[[], bool],
        checks: CheckConfig | None = None,
    ) -> None:
        self.checks = checks or CheckConfig()
        # The checks' rows, built once per configuration: the hot path then builds nothing.
        self._rows: dict[tuple[CheckConfig, str, int | None], tuple[DeviceCheck, ...]] = {}
        self._injector = injector
        self._decide = decide
        self._in_pass = in_pass
        self.records = Records()  # where new records go (the pass begun ahead, if any)
        self.reading = self.records  # the pass the next read evaluates
        self._buffer: ValidationBuffer | None = None
        self.buffers: list[ValidationBuffer] = []
        self._windows_to_load: dict[str, Any] = {}
        self.large: dict[str, LargeValueTracker] = {}
        self._host_checks = False

    # ------------------------------------------------------------------------ device buffers
    @property
    def buffer(self) -> ValidationBuffer | None:
        """The one device check buffer (None before the first device check)."""
        return self._buffer

    def check_buffer(self, device: torch.device) -> ValidationBuffer:
        """The device check buffer, created on ``device`` on first use."""
        if self._buffer is None:
            self._buffer = ValidationBuffer(device, name="", may_inject=self._injector.enabled)
            self.buffers.insert(0, self._buffer)
            if self._windows_to_load:
                self._buffer.load_tracker_state(self._windows_to_load)
                self._windows_to_load = {}
        elif self._buffer.device != torch.device(device):
            raise ValueError(
                f"device checks on {device} but the rerun machine's buffer is on "
                f"{self._buffer.device}: record all checks on one device"
            )
        return self._buffer

    def attach_buffer(self, buffer: ValidationBuffer) -> None:
        """Also read ``buffer`` (slots declared with ``add_check``) in the per-pass read."""
        self.buffers.append(buffer)

    def load_device_windows(self, windows: dict[str, Any]) -> None:
        if self._buffer is not None:
            self._buffer.load_tracker_state(windows)
        else:  # applied when the first device check creates the buffer
            self._windows_to_load = dict(windows)

    def large_state(self) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """The large-value windows (host, device) in their checkpoint form."""
        host = {k: [t.count, t.max_value] for k, t in self.large.items()}
        # Deliberate sync (checkpoint time): the device windows of the in-buffer checks.
        device = self._buffer.tracker_state() if self._buffer is not None else {}
        return host, device

    def load_large_state(self, host: dict[str, Any], device: dict[str, Any]) -> None:
        """Inverse of :meth:`large_state`."""
        self.large = {k: LargeValueTracker(c, m) for k, (c, m) in host.items()}
        if device:
            self.load_device_windows(device)

    def save_trackers(self) -> dict[str, torch.Tensor]:
        return self._buffer.save_trackers() if self._buffer is not None else {}

    def restore_trackers(self, saved: dict[str, torch.Tensor]) -> None:
        if self._buffer is not None:
            self._buffer.restore_trackers(saved)

    # ------------------------------------------------------------------------------ passes
    def new_pass(self, gate_non_fatal: bool) -> None:
        """Start a pass: empty records, buffers cleared with their injection masks."""
        self.records = self.reading = Records()
        self.begin_buffers(gate_non_fatal, adopt_ahead=False)

    def adopt(self, records: Records, gate_non_fatal: bool) -> None:
        """Start the pass begun ahead (``records``): its buffer values stay."""
        self.records = self.reading = records
        self.begin_buffers(gate_non_fatal, adopt_ahead=True)

    def begin_buffers(self, gate_non_fatal: bool, adopt_ahead: bool) -> None:
        for buf in self.buffers:
            buf.set_gate_policy(gate_non_fatal=gate_non_fatal)
            buf.begin([self._decide(k) for k in buf.keys], adopt_ahead=adopt_ahead)

    def read(self) -> Items:
        """The values of the pass being read: the iteration's one deliberate host sync."""
        return read_values(self.reading.pending, self.buffers)

    def read_host_only(self) -> Items:
        """The values of checks recorded while disabled (no device buffer); starts afresh."""
        items = read_values(self.reading.pending, [])
        self.records = self.reading = Records()
        return items

    @property
    def device_evaluable(self) -> bool:
        """Whether the pass being read has a device verdict for every check."""
        return not self.reading.host_evaluated and all(b.device_evaluable for b in self.buffers)

    @contextlib.contextmanager
    def host_only(self) -> Iterator[None]:
        """Record into fresh records evaluated on the host (evaluation: the device buffer
        belongs to training); the pass's records are back after the block."""
        saved = (self.records, self.reading, self._host_checks)
        self.records = self.reading = Records()
        self._host_checks = True
        try:
            yield
        finally:
            self.records, self.reading, self._host_checks = saved

    # ---------------------------------------------------------------------------- recording
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
        device checks (:meth:`check_all_on_device`) for NaN/Inf/large checks: their verdict
        is taken on the device, which lets a loop gate the optimizer step there.
        """
        self._require_pass()
        spec = CheckSpec(
            message, rejection_func, comparison_func or compare_floats, tolerance, fatal
        )
        key = self.records.next_key("", message)
        value = as_scalar(result)
        injected = self._decide(key)
        if injected:
            value = (
                torch.full_like(value, math.nan) if isinstance(value, torch.Tensor) else math.nan
            )
        self.records.pending.append(ValidationRecord(key, spec, value, injected))

    def check_all_on_device(
        self, values: torch.Tensor, checks: Sequence[Sequence[DeviceCheck]]
    ) -> None:
        """Record ``checks[i]`` of element ``i`` of ``values`` (0-d or 1-d), in that order, as
        one call per check would: the same slots and verdicts, but one device op for all of
        them (a write of the values) once their slots are allocated, whatever the number of
        checks. The verdicts are the device's (graph-capturable); device ops only, never a
        sync. Inside ``RerunStateMachine.disabled()`` they are evaluated on the host instead."""
        if values.requires_grad:
            values = values.detach()
        if self._host_checks:  # evaluation: resolved on the host, the buffer stays untouched
            flat = values.reshape(-1)
            for i, row in enumerate(checks):
                for c in row:
                    rule = self.host_rule(c.rule)
                    self.validate_result(flat[i], rule, c.message, None, c.tolerance, c.fatal)
            return
        self._require_pass()
        buffer = self.check_buffer(values.device)
        next_key = self.records.next_key
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

    def check_loss(self, loss: torch.Tensor) -> None:
        """Megatron's checks of one micro-batch's local loss, as :attr:`checks` says: NaN/Inf
        (fatal, tolerance 0: the forward is deterministic) and spiky loss (non-fatal)."""
        wanted = self._row("loss")
        if wanted:
            self.check_all_on_device(loss, (wanted,))

    def check_losses(self, losses: Sequence[torch.Tensor]) -> None:
        """:meth:`check_loss` of each loss of ``losses`` (one per micro-batch, in order) in one
        call: the same slots, messages and verdicts, and one stack plus one device write in all
        instead of one per micro-batch. ``losses`` should be detached (a host dispatch less)."""
        wanted = self._row("loss")
        if not wanted or not losses:
            return
        for loss in losses:
            if loss.numel() != 1:
                raise ValueError(f"a loss to check must be a scalar; got shape {tuple(loss.shape)}")
        flat = [x if x.dim() == 0 else x.reshape(()) for x in losses]
        if any(x.dtype != flat[0].dtype for x in flat):
            flat = [x.double() for x in flat]
        values = flat[0] if len(flat) == 1 else torch.stack(flat)
        self.check_all_on_device(values, [wanted] * len(flat))

    def check_grad_norm(self, norm: torch.Tensor, bucket: int | None = None) -> None:
        """Megatron's checks of a *local* (pre-reduction) grad norm, of DDP bucket ``bucket``
        when given, as :attr:`checks` says: NaN/Inf (fatal) and large grads (non-fatal), with
        tolerance 1e-3 (non-deterministic backward kernels)."""
        wanted = self._row("grads", bucket)
        if wanted:
            self.check_all_on_device(norm, (wanted,))

    def check_grad_norms(self, norms: torch.Tensor) -> None:
        """:meth:`check_grad_norm` of every bucket's norm (``norms[b]``; a 0-d tensor: the one
        bucket's) in one call: the same slots, messages and verdicts, one device write."""
        n = norms.numel()
        wanted = [self._row("grads", b if n > 1 else None) for b in range(n)]
        if wanted and wanted[0]:
            self.check_all_on_device(norms, wanted)

    def _row(self, kind: str, bucket: int | None = None) -> tuple[DeviceCheck, ...]:
        """The ``"loss"`` checks, or the ``"grads"`` checks of ``bucket`` (None: the only
        one), as :attr:`checks` says."""
        key = (self.checks, kind, bucket)
        row = self._rows.get(key)
        if row is None:
            made = loss_checks(self.checks) if kind == "loss" else grad_checks(self.checks, bucket)
            row = self._rows[key] = made
        return row

    def _slot(self, buffer: ValidationBuffer, key: CallKey, check: DeviceCheck) -> int:
        """The buffer slot of ``key``; a new one decides its error injection now."""
        slot = buffer.slot_index(key)
        if slot is not None:
            return slot
        rule = check.rule
        spec = CheckSpec(
            check.message, self.host_rule(rule), compare_floats, check.tolerance, check.fatal
        )
        slot = buffer.slot_for(key, spec, rule)
        if self._decide(key):
            buffer.inject[slot] = True
            buffer.may_inject = True
            buffer.inject_host[slot] = True
        return slot

    def host_rule(self, rule: DeviceRule) -> Callable[..., Any]:
        """The host rejection function of a device rule."""
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

    def _require_pass(self) -> None:
        if not self._in_pass():
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
        """True when ``|result| >= threshold * max`` of the first ``num_samples`` values of
        ``context``.

        Meant as a rejection function (``functools.partial(sm.is_unexpectedly_large,
        threshold=10, context="loss")``): the machine then calls it with host floats at its
        sync point. Called directly with a device tensor it reads it (a sync). NaN/Inf return
        False. ``resample`` restarts the sampling window.
        """
        tracker = self.large.setdefault(context, LargeValueTracker())
        if resample:
            tracker.count, tracker.max_value = 0, 0.0
        return tracker.check(host_float(result), threshold, context, num_samples)
