"""The rerun machine's one per-iteration read: every eager record and every written buffer slot.

The buffers record; this module reads them (the recorder calls it once per pass). The verdicts
read here are the ones the buffer's gate took on the device: NaN/Inf of the same float64
values, the recorded LARGE verdicts.
"""

from __future__ import annotations

import math

import torch

from stalwart.reliability.rerun.checks.buffer import ValidationBuffer
from stalwart.reliability.rerun.checks.rules import (
    UNWRITTEN,
    DeviceRule,
    RuleKind,
    ValidationRecord,
)


def read_values(
    records: list[ValidationRecord], buffers: list[ValidationBuffer]
) -> list[tuple[ValidationRecord, float]]:
    """Host values of every eager record and every written buffer slot, in one read.

    All device scalars are concatenated on the first one's device and copied to the host once
    (a single buffer, the usual case, is copied as it is).
    """
    parts: list[torch.Tensor] = [r.value for r in records if isinstance(r.value, torch.Tensor)]
    used = [b for b in buffers if b.specs]
    snapshots = {id(b): b.take_snapshot() for b in used}
    parts += [b.state[:, : len(b.specs)] for b in used if snapshots[id(b)] is None]
    host: list[float] = []
    if len(parts) == 1 and parts[0].dim() == 2:
        # Deliberate sync: the one per-iteration read of every validation value.
        host = [x for row in parts[0].tolist() for x in row]
    elif parts:
        device = parts[0].device
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        # Deliberate sync: the one per-iteration read of every validation value.
        host = flat.tolist()
    pos = 0
    items: list[tuple[ValidationRecord, float]] = []
    for r in records:
        if isinstance(r.value, torch.Tensor):
            items.append((r, host[pos]))
            pos += 1
        else:
            items.append((r, r.value))
    for b in used:
        n = len(b.specs)
        snapshot = snapshots[id(b)]
        if snapshot is None:
            snapshot, pos = host[pos : pos + 2 * n], pos + 2 * n
        items += _buffer_items(b, snapshot, n)
    return items


def _device_verdict(
    rule: DeviceRule | None, value: float, large: float, injected: bool
) -> bool | None:
    """The verdict the device's gate took for a slot (None: the host decides)."""
    if rule is None:
        return None
    if injected:
        return True
    if rule.kind is RuleKind.NAN:
        return math.isnan(value)
    if rule.kind is RuleKind.INF:
        return math.isinf(value)
    return large > 0.5


def _buffer_items(
    b: ValidationBuffer, flat: list[float], n: int
) -> list[tuple[ValidationRecord, float]]:
    vals, rejected = flat[:n], flat[n : 2 * n]
    items = []
    for i in range(n):
        if vals[i] != UNWRITTEN:
            injected = b.inject_host[i]
            value = math.nan if injected else vals[i]
            verdict = _device_verdict(b.rules[i], value, rejected[i], injected)
            rec = ValidationRecord(b.keys[i], b.specs[i], value, injected, verdict)
            items.append((rec, value))
    return items
