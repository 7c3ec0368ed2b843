"""The training log's interval sums, summed on the host from one copy per loss, are bitwise the
sums a device accumulator makes (one ``add_`` per iteration), with the same counters."""

from __future__ import annotations

import math
import random
import struct

import torch

from stalwart.observability.interval_losses import MAX_DEFERRED, IntervalLosses


def _device_reference(iterations: list[tuple[dict[str, object], object]]) -> dict[str, float]:
    """What the training log computed before: float64 device accumulators, one add per loss."""
    sums: dict[str, torch.Tensor] = {}
    counts = torch.zeros(3, dtype=torch.int64)
    for losses, skipped in iterations:
        if not losses and skipped is True:
            continue
        skip_t = None
        if isinstance(skipped, torch.Tensor):
            skip_t = skipped.reshape(()).to(torch.bool)
            counts[1].add_(skip_t.long())
            counts[0].add_((~skip_t).long())
        else:
            counts[1 if skipped else 0].add_(1)
        bad = False
        for key, loss in losses.items():
            acc = sums.setdefault(key, torch.zeros((), dtype=torch.float64))
            if isinstance(loss, torch.Tensor):
                value = loss.reshape(()).to(torch.float64)
            else:
                value = torch.full_like(acc, float(loss))  # type: ignore[arg-type]
            bad |= not math.isfinite(value.item())
            if skip_t is not None:
                acc.add_(torch.where(skip_t, torch.zeros_like(value), value))
            elif not skipped:
                acc.add_(value)
        counts[2].add_(int(bad))
    out = {f"sum:{k}": v.item() for k, v in sums.items()}
    out.update({f"count:{n}": float(c) for n, c in zip(("advanced", "skipped", "nan"), counts)})
    return out


def _totals(losses: IntervalLosses) -> dict[str, float]:
    read = {k: v.double().item() for k, v in losses.to_read().items()}  # the log's one read
    return losses.totals(read)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _iterations(n: int, seed: int) -> list[tuple[dict[str, object], object]]:
    """Losses of spread magnitudes (the order of the additions decides the rounding), float32,
    bf16 and host floats, NaN/Inf now and then, skipped as a flag or a tensor, and iterations
    skipped without a pass."""
    rng = random.Random(seed)
    out: list[tuple[dict[str, object], object]] = []
    for _ in range(n):
        if rng.random() < 0.03:
            out.append(({}, True))
            continue
        lm = torch.tensor(rng.uniform(0.1, 10.0) * 10 ** rng.randint(-6, 6), dtype=torch.float32)
        if rng.random() < 0.03:
            lm = torch.tensor(rng.choice([math.nan, math.inf, -math.inf]))
        losses: dict[str, object] = {
            "lm loss": lm,
            "aux": torch.tensor(rng.gauss(0, 1), dtype=torch.bfloat16),
            "host": rng.uniform(0, 3),
        }
        kind = rng.random()
        skipped: object = kind < 0.05
        if kind > 0.9:
            skipped = torch.tensor(rng.random() < 0.3)
        out.append((losses, skipped))
    return out


def test_the_host_sums_are_the_device_sums_bitwise_across_folds() -> None:
    iterations = _iterations(2 * MAX_DEFERRED + 37, seed=3)  # two folds, then kept copies
    losses = IntervalLosses()
    for loss, skipped in iterations:
        losses.add(loss, skipped)  # type: ignore[arg-type]
    got, want = _totals(losses), _device_reference(iterations)
    assert set(got) == set(want)
    for key, value in want.items():
        assert _bits(got[key]) == _bits(value) or (math.isnan(got[key]) and math.isnan(value)), key
    assert losses.skipped_without_pass == sum(1 for loss, s in iterations if not loss and s is True)


def test_an_interval_of_finite_losses_sums_exactly_and_resets() -> None:
    iterations = _iterations(3 * MAX_DEFERRED, seed=11)
    finite = [
        (loss, s)
        for loss, s in iterations
        if all(not isinstance(v, torch.Tensor) or torch.isfinite(v) for v in loss.values())
    ]
    losses = IntervalLosses()
    for first in (finite[:100], finite[100:]):  # two intervals
        for loss, skipped in first:
            losses.add(loss, skipped)  # type: ignore[arg-type]
        got, want = _totals(losses), _device_reference(first)
        assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in want.items()}
        losses.reset()


def test_a_loss_tensor_reused_in_place_after_the_call_does_not_change_the_sums() -> None:
    losses = IntervalLosses()
    buffer = torch.zeros(())
    for value in (1.5, 2.25, 4.0):
        buffer.fill_(value)
        losses.add({"lm loss": buffer}, False)
    buffer.fill_(1000.0)  # the caller's own buffer, rewritten before the log step
    got = _totals(losses)
    assert got["sum:lm loss"] == 7.75
    assert (got["count:advanced"], got["count:skipped"], got["count:nan"]) == (3.0, 0.0, 0.0)


def test_a_key_first_seen_after_a_fold_starts_from_zero() -> None:
    losses = IntervalLosses()
    for _ in range(MAX_DEFERRED):
        losses.add({"lm loss": torch.tensor(1.0)}, False)
    losses.add({"lm loss": torch.tensor(1.0), "late": torch.tensor(2.0)}, False)
    got = _totals(losses)
    assert got["sum:lm loss"] == MAX_DEFERRED + 1.0 and got["sum:late"] == 2.0
    assert got["count:advanced"] == MAX_DEFERRED + 1.0
