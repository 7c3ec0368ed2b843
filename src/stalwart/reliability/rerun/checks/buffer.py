"""Validation records and the rerun machine's one device check buffer, :class:`ValidationBuffer`.

A validation call never reads a device value. It records a scalar with its check specification;
the state machine reads all recorded values of an iteration in one deliberate sync.

Two kinds of records:

* Device checks (NaN, Inf, unexpectedly large) are written into the :class:`ValidationBuffer`
  with device ops only, so they work inside a captured CUDA graph: one op per call (the value;
  a slot not written in the pass holds :data:`UNWRITTEN`) whatever the number of checks of the
  value (:meth:`ValidationBuffer.record_run`).
  The buffer turns the pass's rejections into a skip gate on the device (fused AdamW's
  ``found_inf``: the optimizer step is then enqueued before the host read and skips itself),
  NaN/Inf verdicts computed from all values at once; the read takes the same verdicts.
* Any other rejection function is evaluated on the host at the read (``ValidationRecord`` with a
  device tensor or a float), with the conventions below.

The rules, specs and records, and how a rejection is evaluated on the host, are in
:mod:`stalwart.reliability.rerun.checks.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stalwart.reliability.rerun.checks.rules import (
    UNWRITTEN,
    CheckSpec,
    DeviceRule,
    RuleKind,
    device_rule_of,
)
from stalwart.reliability.rerun.checks.stats import compare_floats
from stalwart.reliability.rerun.types import CallKey


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ValidationBuffer:
    """Static device buffer for checks, eager or inside a captured CUDA graph.

    Slots are either declared up front with :meth:`add_check` (one per call site and micro-batch)
    or allocated on the first record of a key (:meth:`slot_for`, what the recorder's
    ``check_loss``/``check_grad_norm`` use; the warm-up passes before a capture allocate them).
    :meth:`record` only performs device ops on preallocated tensors, so a captured graph writes
    its values and LARGE verdicts on every replay (NaN/Inf verdicts are taken
    from the values by the gate and the read). The machine clears the buffer before each pass,
    sets the error-injection mask, and reads it in its one per-iteration sync.

    ``may_inject=False`` promises that no slot's error-injection flag is ever set (the rerun
    machine passes whether its injector is enabled); the gate then skips that term.

    ``gate`` (float32, 1.0 = skip) is what fused AdamW reads as ``found_inf``:
    :meth:`update_gate` sets it from the pass's device verdicts, max-reduced across ranks.
    """

    state: torch.Tensor  # rows: values, LARGE verdicts

    def __init__(
        self,
        device: torch.device | str,
        name: str = "graph",
        capacity: int = 256,
        may_inject: bool = True,
    ) -> None:
        self.name = name
        self.may_inject = may_inject  # False: no slot is ever injected (two gate ops fewer)
        self.device = torch.device(device)
        self._allocate_tensors(capacity)
        self.gate = torch.zeros((), dtype=torch.float32, device=self.device)
        self.specs: list[CheckSpec] = []
        self.keys: list[CallKey] = []
        self.rules: list[DeviceRule | None] = []
        self.inject_host: list[bool] = []
        self._gate_host: list[bool] = []
        self._gate_non_fatal = True
        self._has_large = False  # a LARGE slot exists (its verdicts then count for the gate)
        self._slots: dict[CallKey, int] = {}
        # Slots whose value is always written together with both a NaN and an Inf check of it
        # (a run of width >= 2 covering both rules), and slots ever written otherwise: when
        # every slot is paired, counted and neither injected nor LARGE, the gate is "any value
        # not finite" (:meth:`_paired_gate`), two device ops instead of six.
        self._paired: set[int] = set()
        self._unpaired: set[int] = set()
        self._trackers: dict[str, torch.Tensor] = {}  # context -> [count, max] (float64)
        # Look-ahead support: values read ahead, and a pass already begun.
        self._snapshot: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._begun_ahead = False
        self._pinned: torch.Tensor | None = None
        self._pinned_event: torch.cuda.Event | None = None

    def _allocate_tensors(self, capacity: int, old: ValidationBuffer | None = None) -> None:
        """The device tensors (copied from their smaller versions when growing).

        ``state`` rows: values (:data:`UNWRITTEN` until written in the pass), LARGE verdicts
        (float64, read in one copy); ``is_nan`` / ``is_inf``: the slot's rule, for the gate's
        verdicts of NaN/Inf checks.
        """

        def grown(
            shape: tuple[int, ...], dtype: torch.dtype, name: str, fill: float = 0.0
        ) -> torch.Tensor:
            new = torch.full(shape, fill, dtype=dtype, device=self.device)
            if old is not None:
                prev: torch.Tensor = getattr(old, name)
                new[..., : prev.shape[-1]].copy_(prev)
            return new

        old_capacity = 0 if old is None else int(old.state.shape[-1])
        self.state = grown((2, capacity), torch.float64, "state")
        self.state[0, old_capacity:].fill_(UNWRITTEN)
        self.inject = grown((capacity,), torch.bool, "inject")
        self.in_gate = grown((capacity,), torch.float64, "in_gate")
        self.is_nan = grown((capacity,), torch.bool, "is_nan")
        self.is_inf = grown((capacity,), torch.bool, "is_inf")
        # NaN / Inf slots and all slots that count for the gate: kept from the rules and the
        # gate policy (off the hot path), so the gate takes a few ops per pass.
        self.nan_gate = grown((capacity,), torch.bool, "nan_gate")
        self.inf_gate = grown((capacity,), torch.bool, "inf_gate")
        self.counted = grown((capacity,), torch.bool, "counted")
        self._zeros = torch.zeros(capacity, dtype=torch.float64, device=self.device)
        self.values, self.rejected = self.state.unbind(0)
        self._runs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._prefixes: dict[int, tuple[torch.Tensor, ...]] = {}

    def _gate_inputs(self) -> tuple[torch.Tensor, ...]:
        return (
            self.values,
            self.nan_gate,
            self.inf_gate,
            self.inject,
            self.rejected,
            self.counted,
            self._zeros,
        )

    def _update_gate_masks(self) -> None:
        """The gate's masks from the slot rules and ``in_gate`` (in place: a captured graph
        keeps their addresses). Eager only; called when a slot or the policy changes."""
        counted = self.in_gate.bool()
        torch.logical_and(self.is_nan, counted, out=self.nan_gate)
        torch.logical_and(self.is_inf, counted, out=self.inf_gate)
        self.counted.copy_(counted)

    # ------------------------------------------------------------------------------ slots
    def add_check(
        self,
        message: str,
        rejection_func: Callable[..., Any] | None,
        *,
        comparison_func: Callable[..., Any] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> int:
        """Reserve a slot; returns its index for :meth:`record`. Not graph-safe: call before
        capture."""
        seq = 1 + sum(1 for s in self.specs if s.message == message)
        spec = CheckSpec(
            message, rejection_func, comparison_func or compare_floats, tolerance, fatal
        )
        return self._allocate((self.name, message, seq), spec, device_rule_of(rejection_func))

    def slot_index(self, key: CallKey) -> int | None:
        """The slot of ``key``, or None before its first record."""
        return self._slots.get(key)

    def slot_for(self, key: CallKey, spec: CheckSpec, rule: DeviceRule | None) -> int:
        """The slot of ``key``, allocated on first use (outside capture)."""
        slot = self._slots.get(key)
        return self._allocate(key, spec, rule) if slot is None else slot

    def _allocate(self, key: CallKey, spec: CheckSpec, rule: DeviceRule | None) -> int:
        if _capturing(self.device):
            raise RuntimeError(
                f"validation call {key} first made during CUDA graph capture: its slot must be "
                "allocated in an eager warm-up pass (the capture must repeat the warm-up's calls)"
            )
        if len(self.specs) >= self.values.numel():
            self._grow()
        slot = len(self.specs)
        self.specs.append(spec)
        self.keys.append(key)
        self.rules.append(rule)
        self.inject_host.append(False)
        in_gate = spec.fatal or self._gate_non_fatal
        self._gate_host.append(in_gate)
        self.in_gate[slot] = 1.0 if in_gate else 0.0
        kind = None if rule is None else rule.kind
        if kind is RuleKind.NAN or kind is RuleKind.INF:
            (self.is_nan if kind is RuleKind.NAN else self.is_inf)[slot] = True
        self._update_gate_masks()
        self._slots[key] = slot
        if rule is not None and rule.kind is RuleKind.LARGE:
            self._has_large = True
            if rule.context not in self._trackers:
                self._trackers[rule.context] = torch.zeros(
                    2, dtype=torch.float64, device=self.device
                )
        return slot

    def _grow(self) -> None:
        """Double the capacity (eager only: a captured graph keeps writing the old tensors)."""
        self._allocate_tensors(2 * self.values.numel(), old=self)

    @property
    def device_evaluable(self) -> bool:
        """Whether every slot's rejection is evaluated on the device (the gate then decides)."""
        return all(rule is not None for rule in self.rules)

    # ----------------------------------------------------------------------------- writes
    def record(self, slot: int, value: torch.Tensor) -> None:
        """Write a one-element tensor into ``slot`` (device ops only).

        NaN/Inf verdicts are taken from the values where they are needed (the gate, the read),
        so a record is one write; a LARGE rule also updates its sampling window here.
        """
        v = value.detach()
        self.record_run(slot, 1, v.reshape(()) if v.dim() else v)

    def record_run(self, start: int, width: int, values: torch.Tensor) -> None:
        """Write element ``i`` of ``values`` (0-d or 1-d, ``m`` elements) into the ``width``
        consecutive slots from ``start + i * width``: one device op for the whole run, plus the
        sampling-window update of each LARGE slot. ``values`` must not require grad."""
        m = values.numel()
        run = self._runs.get((start, m, width))
        if run is None:  # views cached per run (a capture then slices nothing)
            run = self.values[start : start + m * width].view(m, width)
            self._runs[(start, m, width)] = run
            self._note_pairs(start, m, width)
        run.copy_(values.reshape(m, 1) if values.dim() else values)
        for slot in range(start, start + m * width):
            rule = self.rules[slot]
            if rule is not None and rule.kind is RuleKind.LARGE:
                self._record_large(slot, rule, values.reshape(-1)[(slot - start) // width])

    def _note_pairs(self, start: int, m: int, width: int) -> None:
        """Classify the slots of a new run: paired when each value's slots hold both a NaN and
        an Inf check (off the hot path: once per run)."""
        for i in range(m):
            group = range(start + i * width, start + (i + 1) * width)
            kinds = {rule.kind for rule in (self.rules[s] for s in group) if rule is not None}
            paired = {RuleKind.NAN, RuleKind.INF} <= kinds
            (self._paired if paired else self._unpaired).update(group)

    def _paired_gate(self, n: int) -> bool:
        """Whether the gate of the first ``n`` slots is exactly "some value is not finite":
        every slot counts, is written only in NaN+Inf pairs (a NaN-only slot holding an Inf
        would otherwise differ), and no slot is injected or LARGE."""
        if self.may_inject or self._has_large or not all(self._gate_host[:n]):
            return False
        return (
            not self._unpaired
            and len(self._paired) >= n
            and all(s in self._paired for s in range(n))
        )

    def _record_large(self, slot: int, rule: DeviceRule, value: torch.Tensor) -> None:
        """The LARGE verdict of ``slot``, in call order (its window depends on earlier values)."""
        v = torch.where(self.inject[slot], math.nan, value.to(torch.float64))
        self.rejected[slot].copy_(self._large(rule, v) | self.inject[slot])

    def _large(self, rule: DeviceRule, v: torch.Tensor) -> torch.Tensor:
        """``is_unexpectedly_large`` on the device: sample the max of the first ``num_samples``
        finite values of the context, then reject ``|v| >= threshold x max``."""
        tracker = self._trackers[rule.context]
        count, peak = tracker[0], tracker[1]
        a = v.abs()
        finite = torch.isfinite(a)
        sampling = count < rule.num_samples
        verdict = finite & ~sampling & (a >= peak * rule.threshold)
        update = finite & sampling
        peak.copy_(torch.where(update, torch.maximum(peak, a), peak))
        count.add_(update.to(torch.float64))
        return verdict

    def update_gate(self, group: dist.ProcessGroup | None = None) -> None:
        """Set ``gate`` to 1.0 when a written slot of this pass was rejected on the device (and
        counts for the gate), else 0.0; max-reduced across ``group`` (device work only).

        The verdicts are those the read takes: NaN/Inf of the written value, injection, the
        LARGE verdicts recorded with the values.
        """
        n = len(self.specs)
        if n == 0:
            self.gate.zero_()
            return
        views = self._prefixes.get(n)
        if views is None:  # cached per slot count (a capture then slices nothing)
            views = tuple(t[:n] for t in self._gate_inputs())
            self._prefixes[n] = views
        v, nan_gate, inf_gate, inject, large, counted, zeros = views
        # An unwritten slot holds UNWRITTEN, which is finite: no NaN/Inf verdict.
        if self._paired_gate(n):
            # sum(v * 0) is NaN exactly when some value is NaN or +-Inf (Inf * 0 is NaN): one
            # dot product and one compare, where isfinite alone is four elementwise kernels.
            total = torch.dot(v, zeros)
            torch.ne(total, total, out=self.gate)
            self._reduce_gate(group)
            return
        hit = torch.where(nan_gate, v.isnan(), v.isinf().logical_and_(inf_gate))
        extra = None
        if self.may_inject:  # fixed for the buffer's life: a captured gate stays right
            extra = inject.logical_and(counted)
        if self._has_large:
            large_hit = large.bool().logical_and_(counted)
            extra = large_hit if extra is None else extra.logical_or_(large_hit)
        if extra is not None:  # stale flags of slots this pass did not write do not count
            hit = hit.logical_or_(extra.logical_and_(v != UNWRITTEN))
        self.gate.copy_(hit.any())
        self._reduce_gate(group)

    def _reduce_gate(self, group: dist.ProcessGroup | None) -> None:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(self.gate, op=dist.ReduceOp.MAX, group=group)

    def raise_gate(self, flag: torch.Tensor) -> None:
        """Also skip the step when ``flag`` (a device bool or 0/1, the same on every rank, e.g.
        the replica fingerprint comparison) is set; device work only."""
        self.gate.copy_(torch.maximum(self.gate, flag.to(self.gate.dtype)))

    # ------------------------------------------------------------------------ pass control
    def begin(self, inject_mask: list[bool], *, adopt_ahead: bool = False) -> None:
        """Machine hook before a pass: mark every slot unwritten, upload the mask on change.

        ``adopt_ahead``: the pass was begun by :meth:`begin_ahead` (its writes may have landed):
        nothing is cleared.
        """
        begun, self._begun_ahead = self._begun_ahead, False
        if not (adopt_ahead and begun):
            self.values.fill_(UNWRITTEN)
        if inject_mask != self.inject_host:
            # An injection the machine did not announce (a peer replaying a suspect's shipped
            # injection with its own injector off): eager gates count it from now on.
            self.may_inject = self.may_inject or any(inject_mask)
            n = len(inject_mask)
            self.inject[:n].copy_(torch.tensor(inject_mask, dtype=torch.bool))
            self.inject_host = list(inject_mask)

    def set_gate_policy(self, gate_non_fatal: bool) -> None:
        """Which slots the gate counts: all (validate_results reruns on any rejection) or only
        fatal ones (disabled mode only raises on those). Uploads only on change."""
        self._gate_non_fatal = gate_non_fatal
        wanted = [spec.fatal or gate_non_fatal for spec in self.specs]
        if wanted != self._gate_host and wanted:
            self.in_gate[: len(wanted)].copy_(torch.tensor(wanted, dtype=torch.float64))
            self._update_gate_masks()
        self._gate_host = wanted

    def snapshot(self) -> None:
        """Freeze this pass's values for the machine's next read, without waiting.

        For a look-ahead launch of the next forward-backward before this pass is read: the
        values are copied (stream-ordered, to pinned memory on CUDA) and the next read uses the
        copy, so the next pass may overwrite the buffer meanwhile.
        """
        flat = self.state[:, : len(self.specs)]
        if not flat.is_cuda:
            self._snapshot = (flat.clone(), None)
            return
        # One pinned buffer and event, reused: the previous snapshot was read before this one.
        if self._pinned is None or self._pinned.shape != flat.shape:
            self._pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._pinned_event = torch.cuda.Event()
        self._pinned.copy_(flat, non_blocking=True)
        assert self._pinned_event is not None
        self._pinned_event.record()
        self._snapshot = (self._pinned, self._pinned_event)

    def begin_ahead(self) -> None:
        """Begin the next pass now (every slot unwritten, device work only), for a launch that
        precedes the machine's own :meth:`begin`; the injection mask stays as it is."""
        self.values.fill_(UNWRITTEN)
        self._begun_ahead = True

    def drop_ahead(self) -> None:
        """Forget a pass begun ahead (its launch was discarded): the next begin clears."""
        self._begun_ahead = False

    def take_snapshot(self) -> list[float] | None:
        """Host values and LARGE verdicts of the last :meth:`snapshot` (consumed)."""
        if self._snapshot is None:
            return None
        host, event = self._snapshot
        self._snapshot = None
        if event is not None:
            event.synchronize()  # Deliberate sync: waits only for the copy, not for later work.
        return host.reshape(-1).tolist()

    # ---------------------------------------------------------------------------- trackers
    def save_trackers(self) -> dict[str, torch.Tensor]:
        """Device copies of the large-value trackers (no sync), to undo a pass's updates."""
        return {ctx: t.clone() for ctx, t in self._trackers.items()}

    def restore_trackers(self, saved: dict[str, torch.Tensor]) -> None:
        """Put the trackers back in place (``copy_``: a captured graph keeps their addresses)."""
        for ctx, t in saved.items():
            if ctx in self._trackers:
                self._trackers[ctx].copy_(t)

    def tracker_state(self) -> dict[str, list[float]]:
        """Host ``[count, max]`` per context (a sync: checkpoint time only)."""
        return {ctx: [float(x) for x in t.tolist()] for ctx, t in self._trackers.items()}

    def load_tracker_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`tracker_state` (contexts not yet known are created)."""
        for ctx, (count, peak) in state.items():
            tracker = self._trackers.setdefault(
                ctx, torch.zeros(2, dtype=torch.float64, device=self.device)
            )
            tracker.copy_(torch.tensor([float(count), float(peak)], dtype=torch.float64))
