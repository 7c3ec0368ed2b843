"""Every iteration's values kept on the device and read once per log interval.

The training log writes each completed iteration's device scalars (the losses, learning rate,
gradient norm, loss scale, zeros, parameter norm, the skip flag) into one row of a small static
device tensor, :class:`IterationRing`; host values (a Python float learning rate, the consumed
samples, the host's clock) are kept beside it on the host. Nothing is read per iteration: a row
is one ``torch.stack(..., out=row)`` (one kernel, into a view by a host index: no allocation,
no read, no synchronisation). At a log step the filled rows (:meth:`IterationRing.to_read`) join
the values that step reads anyway, in the training log's one transfer (its ``.tolist()``, the
sync a log step already makes), and :meth:`IterationRing.rows` turns the read floats back into
rows: no second copy, no event, no extra synchronisation.

The ring holds one log interval (``capacity`` = ``--log-interval``; it doubles, by a device
copy, when an interval is longer: a caller that never logs). Off (``--no-log-every-iteration``,
``LogConfig(log_every_iteration=False)``), the log holds a :class:`NullIterationRing`: no
kernel, no copy, no row.

Rows come back as ``{"iteration": n, <name>: value, ...}`` with every device value as a Python
float and the host values as given. On a CUDA device each row also records an event when the
stream reaches it (no wait), and ``iteration_ms`` is the device time from the previous row's
event (none for a run's first row): the iteration's device time, the idle gaps included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IterationRing", "NullIterationRing", "Ring"]


@dataclass
class _Slot:
    """A row's host half: which columns its device values went to, and its host values."""

    iteration: int
    names: tuple[str, ...]
    host: dict[str, Any]
    event: torch.cuda.Event | None = None  # the stream reached the iteration's end (CUDA)


class IterationRing:
    """Per-iteration device scalars in a static ``[capacity, width]`` float64 tensor (see the
    module docstring). Not thread-safe; one per training log (rank 0's)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"IterationRing: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._buf: torch.Tensor | None = None  # allocated at the first device value
        self._slots: list[_Slot] = []
        self._last_event: torch.cuda.Event | None = None  # the previous interval's last end

    def write(
        self, iteration: int, values: Mapping[str, Any], host: Mapping[str, Any] | None = None
    ) -> None:
        """Keep ``iteration``'s ``values``: tensors (one element each, any device/dtype) go to
        the device row, anything else to the host half. Device work only (no read)."""
        tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        kept = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        kept.update(host or {})
        event = None
        if tensors:
            row = self._row(len(self._slots), len(tensors), next(iter(tensors.values())))
            device = row.device
            torch.stack(
                [_scalar(t, device) for t in tensors.values()], out=row[: len(tensors)]
            )  # one kernel; stack converts each dtype into the float64 row
            if device.type == "cuda":  # the device time between iteration ends; no wait
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
        self._slots.append(_Slot(iteration, tuple(tensors), kept, event))

    def __len__(self) -> int:
        return len(self._slots)

    def to_read(self) -> torch.Tensor | None:
        """The filled rows, flattened (a view of the device buffer), for the log step's one
        transfer; None when no row holds a device value."""
        if self._buf is None or not self._slots:
            return None
        return self._buf[: len(self._slots)].reshape(-1)

    def rows(self, read: Sequence[float] = ()) -> list[dict[str, Any]]:
        """The kept iterations as host rows, in order, and an empty ring. ``read``: the values
        of :meth:`to_read` as host floats (the log step read them)."""
        slots, self._slots = self._slots, []
        width = self._buf.shape[1] if self._buf is not None else 0
        out = []
        for i, slot in enumerate(slots):
            row: dict[str, Any] = {"iteration": slot.iteration}
            row.update(zip(slot.names, read[i * width : i * width + len(slot.names)], strict=True))
            row.update(slot.host)
            if slot.event is not None:
                if self._last_event is not None:
                    # Both ends completed before the log step's read returned: no wait here.
                    row["iteration_ms"] = self._last_event.elapsed_time(slot.event)
                self._last_event = slot.event
            out.append(row)
        return out

    def _row(self, slot: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """Row ``slot`` of the buffer, grown (device copy) when the interval or the row is
        larger than it holds."""
        buf = self._buf
        if buf is None:
            buf = torch.zeros(self.capacity, width, dtype=torch.float64, device=like.device)
        elif slot >= buf.shape[0] or width > buf.shape[1]:
            grown = torch.zeros(
                max(buf.shape[0] * 2 if slot >= buf.shape[0] else buf.shape[0], slot + 1),
                max(width, buf.shape[1]),
                dtype=buf.dtype,
                device=buf.device,
            )
            grown[: buf.shape[0], : buf.shape[1]].copy_(buf)
            buf = grown
        self._buf = buf
        return buf[slot]


class NullIterationRing:
    """The ring switched off: keeps nothing, issues nothing."""

    capacity = 0

    def write(
        self, iteration: int, values: Mapping[str, Any], host: Mapping[str, Any] | None = None
    ) -> None: ...

    def __len__(self) -> int:
        return 0

    def to_read(self) -> None:
        return None

    def rows(self, read: Sequence[float] = ()) -> list[dict[str, Any]]:
        return []


Ring = IterationRing | NullIterationRing


def _scalar(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d tensor on ``device`` (a view; a copy only from another device)."""
    if value.requires_grad:
        value = value.detach()
    if value.dim():
        value = value.reshape(())
    return value if value.device == device else value.to(device, non_blocking=True)
