"""Device-side validation flags that are written inside a captured iteration and read once.

Megatron turns its NaN check off under full-iteration graphs because the check syncs with the
host. Here the check is device work: ``forward_step_func`` calls
``flags.record_nonfinite("loss", loss)`` (a few tiny kernels, captured with the rest), the
graph's ``reset_()`` clears the counters at the start of every replay, and the training loop reads
all counters with one host sync after the iteration (``flags.read()``), then decides whether to
run the optimizer (skip it for a rejected iteration) or start a rerun.

To keep that read off the critical path, ``flags.update_skip_gate_(gate)`` (at the end of the
captured forward-backward) turns the counters into a device-side skip flag for a gated
:class:`~stalwart.graphs.OptimizerGraph`: the optimizer replay is then enqueued before the read and
skips itself on the device when a check failed.

Any object with a device-only ``reset_()`` (e.g. the rerun state machine's buffers) can be passed
to :class:`~stalwart.graphs.FullIterationGraph` as ``validation_buffer`` instead.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class FlagReport:
    """Counts of failed checks per name for one iteration; ``ok`` when all are zero."""

    counts: dict[str, int]

    @property
    def ok(self) -> bool:
        """True when no check fired."""
        return not any(self.counts.values())

    @property
    def failed(self) -> list[str]:
        """Names of the checks that fired."""
        return [name for name, count in self.counts.items() if count]


class CheckKind(enum.Enum):
    """How a named check's accumulator is interpreted at read time."""

    COUNT = "count"  # number of iterations/micro-batches where the condition held
    NONFINITE = "nonfinite"  # running sum of values; failed when it is NaN/Inf


class DeviceFlags:
    """Fixed-address float32 accumulators, one per named check, living on ``device``.

    ``record_*`` methods only launch device kernels (graph-capturable); allocate before capture,
    the tensor's address never changes. ``record_nonfinite`` costs one kernel for a scalar: it adds
    the value to the accumulator, and NaN/Inf propagate through the sum.
    """

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"DeviceFlags needs unique, non-empty check names, got {list(names)}")
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._kinds: dict[str, CheckKind] = {}
        self.values = torch.zeros(len(self.names), dtype=torch.float32, device=device)
        # True where a check counts (failed when > 0) rather than sums (failed when non-finite).
        self._count_mask = torch.zeros(len(self.names), dtype=torch.bool, device=device)

    def reset_(self) -> None:
        """Clear all accumulators (device work only)."""
        self.values.zero_()

    def _slot(self, name: str, kind: CheckKind) -> torch.Tensor:
        known = name in self._kinds
        if self._kinds.setdefault(name, kind) is not kind:
            raise ValueError(f"check {name!r} is used as both {self._kinds[name]} and {kind}")
        if not known and kind is CheckKind.COUNT:
            # First use happens in an eager warm-up call, before capture (a device write).
            self._count_mask[self._index[name]] = True
        return self.values[self._index[name]]

    def record(self, name: str, failed: torch.Tensor) -> None:
        """Count ``name`` as failed when any element of the boolean tensor ``failed`` is true."""
        self._slot(name, CheckKind.COUNT).add_(failed.any().to(torch.float32))

    def record_nonfinite(self, name: str, tensor: torch.Tensor) -> None:
        """Fail ``name`` when ``tensor`` has a NaN/Inf (Megatron's NaN check), one kernel per scalar.

        Non-scalar tensors are summed first; a sum of finite values above ~3e38 would overflow and
        read as a failure: use ``record(name, ~torch.isfinite(t))`` for such tensors.
        """
        value = tensor.detach()
        self._slot(name, CheckKind.NONFINITE).add_(
            value.reshape(()) if value.numel() == 1 else value.sum()
        )

    def record_above(
        self, name: str, tensor: torch.Tensor, threshold: torch.Tensor | float
    ) -> None:
        """Count ``tensor`` as failed when any element exceeds ``threshold`` (device or float)."""
        self.record(name, tensor.detach() > threshold)

    def update_skip_gate_(self, gate: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Write 1.0 into ``gate`` if any check failed so far, else 0.0 (device work only).

        With ``group`` of more than one rank the gate is max-reduced across it (one tiny
        collective, capturable on NCCL), so every replica skips or steps together.
        """
        failed = torch.where(self._count_mask, self.values > 0, ~torch.isfinite(self.values))
        gate.copy_(failed.any())
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(gate, op=dist.ReduceOp.MAX, group=group)

    def read_async(self) -> PendingFlags:
        """Start copying the accumulators to the host without waiting (no sync now).

        For loops that let the device decide (a gated optimizer skips a failed iteration) and
        only need to *learn* about failures later, e.g. to count skipped iterations: call
        ``result()`` on the returned handle an iteration later, when the copy is long done. A
        rerun of the failed iteration is then no longer possible (its inputs are overwritten),
        so the rerun state machine uses :meth:`read` instead.
        """
        return PendingFlags(self, self.values.detach().clone())

    def report(self, values: list[float]) -> FlagReport:
        """Interpret host values of the accumulators (from :meth:`read` or a pending read)."""
        counts = {}
        for name, value in zip(self.names, values):
            if self._kinds.get(name) is CheckKind.NONFINITE:
                counts[name] = 0 if math.isfinite(value) else 1
            else:
                counts[name] = int(value)
        return FlagReport(counts)

    def read(self) -> FlagReport:
        """Copy the accumulators to the host and report failures per check."""
        # Deliberate sync: the one per-iteration validation read, after the replay.
        return self.report(self.values.tolist())


class PendingFlags:
    """A device-to-host copy of one iteration's flags in flight (see ``DeviceFlags.read_async``).

    The snapshot is taken on the device (stream-ordered after the iteration), then copied to
    pinned host memory with an event; ``result()`` waits only for that copy.
    """

    def __init__(self, flags: DeviceFlags, snapshot: torch.Tensor) -> None:
        self._flags = flags
        if snapshot.is_cuda:
            self._host = torch.empty(snapshot.shape, dtype=snapshot.dtype, pin_memory=True)
            self._host.copy_(snapshot, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = snapshot, None

    def done(self) -> bool:
        """True when ``result()`` would not wait."""
        return self._event is None or self._event.query()

    def result(self) -> FlagReport:
        """The iteration's report; waits for the copy if it is still in flight."""
        if self._event is not None:
            self._event.synchronize()  # deliberate, usually free: the copy finished long ago
        return self._flags.report(self._host.tolist())
