"""Rerun-capable validation whose host read overlaps the next iteration's forward-backward.

With the optimizer skip decided on the device (a gated :class:`OptimizerGraph`), the only reason
left to read the validation flags on the host every iteration is the rerun: a rejected iteration
must be replayed on its own inputs and RNG state before anything else touches them. Reading right
after the iteration stalls the GPU while the host issues the next one (measured: +4-8% at the
``tiny`` preset, docs/benchmarks-graphs.md). :class:`PipelinedGraphLoop` launches iteration
``i + 1``'s forward-backward first and reads iteration ``i``'s flags while it runs, so the GPU
always has work queued:

    iteration i:   [fwd-bwd i][opt i, gated] [fwd-bwd i+1] ...
    host:                      read flags of i ^ (already copied; the GPU is busy with i + 1)

Nothing is lost for the rerun. The gated optimizer step of a rejected ``i`` left parameters and
moments untouched, so ``i + 1``'s forward-backward ran on the unstepped weights: its result is
discarded, ``i`` is replayed on its own micro-batches (kept by this loop) with its RNG state
restored, and the caller gets both reports. Usage in a hand-written loop::

    loop = PipelinedGraphLoop(graph, optimizer_graph, flags)   # optimizer_graph has skip_gate
    for it, batches in enumerate(micro_batches_per_iteration):
        resolution = loop.step(batches, lr=schedule(it), forward_step_func=fwd, model=model)
        if resolution is not None and not resolution.accepted:
            handle(resolution)      # e.g. checkpoint + exit; or loop.step(batches) to go on
    last = loop.flush()             # before evaluation, checkpoints and at the end

Returned values (losses) of an iteration are cloned on the device at launch, because the next
replay overwrites the graph's static outputs before the iteration is resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from stalwart.graphs.full_iteration import FullIterationGraph, _clone_tensors
from stalwart.graphs.optimizer import OptimizerGraph
from stalwart.graphs.validation import FlagReport, PendingFlags


class Flags(Protocol):
    """The validation state the loop reads (:class:`~stalwart.graphs.DeviceFlags`)."""

    def read(self) -> FlagReport: ...

    def read_async(self) -> PendingFlags: ...


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The verdict on one iteration.

    ``report``: the iteration's checks. ``outputs``: its forward-backward return value (device
    tensors, cloned). When rejected, ``rerun_report`` / ``rerun_outputs`` come from replaying it
    on the same inputs and RNG state: a fault that does not reproduce there is transient.
    """

    iteration: int
    report: FlagReport
    outputs: Any
    rerun_report: FlagReport | None = None
    rerun_outputs: Any = None

    @property
    def accepted(self) -> bool:
        """True when every check passed (the device-gated optimizer step was taken)."""
        return self.report.ok

    @property
    def reproducible(self) -> bool | None:
        """Rejected iterations: whether the rerun failed again; None when accepted."""
        return None if self.rerun_report is None else not self.rerun_report.ok


@dataclasses.dataclass
class _InFlight:
    iteration: int
    batches: Sequence[Any]
    kwargs: dict[str, Any]
    rng_state: torch.Tensor
    outputs: Any
    pending: PendingFlags | None = None


class PipelinedGraphLoop:
    """Drive a full-iteration graph and a gated optimizer graph with a one-iteration-late read.

    Args:
        graph: the forward-backward (its function records the checks into ``flags`` and writes
            the optimizer's skip gate at the end, e.g. ``flags.update_skip_gate_(gate)``).
        optimizer_graph: built with ``skip_gate`` (fused AdamW reads it as ``found_inf``).
        flags: the validation flags the graph writes (reset by the graph every iteration).

    Contract: parameters are final for iteration ``i`` only once ``i`` is resolved (the next
    ``step`` or :meth:`flush` returns its :class:`Resolution`); call :meth:`flush` before reading
    them (evaluation, checkpoints). Only the default generator's RNG state of the graph's device
    is saved and restored for reruns.
    """

    def __init__(
        self, graph: FullIterationGraph, optimizer_graph: OptimizerGraph, flags: Flags
    ) -> None:
        if optimizer_graph.skip_gate is None:
            raise ValueError(
                "PipelinedGraphLoop needs an OptimizerGraph built with skip_gate: a rejected "
                "iteration must skip its optimizer step on the device before the host reads"
            )
        self._graph = graph
        self._optimizer = optimizer_graph
        self._flags = flags
        self._device = graph.device
        self._in_flight: _InFlight | None = None
        self.next_iteration = 0

    def step(
        self, batches: Sequence[Any], *, lr: float | None = None, **kwargs: Any
    ) -> Resolution | None:
        """Launch iteration ``next_iteration`` on ``batches`` (its micro-batches) and resolve the
        previous one.

        ``kwargs`` go to the graph call (``forward_step_func``, ``model``, ...);
        ``data_iterator`` and ``num_microbatches`` come from ``batches``. Returns the previous
        iteration's resolution (None when there was none). When that one was rejected, this
        call's iteration is discarded (it ran on unstepped weights) and ``next_iteration`` does
        not advance: call ``step`` with the same batches to run it again.
        """
        current = self._launch(batches, kwargs)
        previous, self._in_flight = self._in_flight, None
        resolution = self._resolve(previous, next_rng_state=current.rng_state)
        if resolution is not None and not resolution.accepted:
            return resolution
        self._optimizer.step(lr, gated=True, overlap=True)
        current.pending = self._flags.read_async()  # snapshot before the next replay resets
        self._optimizer.join()
        self._in_flight = current
        self.next_iteration += 1
        return resolution

    def flush(self) -> Resolution | None:
        """Resolve the iteration in flight now (a host sync); None when there is none."""
        previous, self._in_flight = self._in_flight, None
        return self._resolve(previous, next_rng_state=None)

    def _launch(self, batches: Sequence[Any], kwargs: dict[str, Any]) -> _InFlight:
        rng_state = self._get_rng_state()
        outputs = self._run_graph(batches, kwargs)
        return _InFlight(self.next_iteration, list(batches), dict(kwargs), rng_state, outputs)

    def _run_graph(self, batches: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        outputs = self._graph(**kwargs, data_iterator=iter(batches), num_microbatches=len(batches))
        return _clone_tensors(outputs)  # the next replay overwrites the static outputs

    def _resolve(
        self, in_flight: _InFlight | None, next_rng_state: torch.Tensor | None
    ) -> Resolution | None:
        if in_flight is None:
            return None
        assert in_flight.pending is not None
        # Deliberate sync, usually free: waits for the copy enqueued after that iteration's
        # forward-backward while the GPU already runs the next one.
        report = in_flight.pending.result()
        if report.ok:
            return Resolution(in_flight.iteration, report, in_flight.outputs)
        # Rejected: its optimizer step skipped itself on the device. Replay it on its inputs.
        self._set_rng_state(in_flight.rng_state)
        rerun_outputs = self._run_graph(in_flight.batches, in_flight.kwargs)
        rerun_report = self._flags.read()  # deliberate sync: the rerun's verdict
        if next_rng_state is not None:
            self._set_rng_state(next_rng_state)  # the discarded iteration runs again from here
        return Resolution(
            in_flight.iteration, report, in_flight.outputs, rerun_report, rerun_outputs
        )

    def _get_rng_state(self) -> torch.Tensor:
        if self._device.type == "cuda":
            return torch.cuda.get_rng_state(self._device)
        return torch.get_rng_state()

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_rng_state(state, self._device)
        else:
            torch.set_rng_state(state)
