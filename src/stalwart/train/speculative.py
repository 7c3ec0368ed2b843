"""Launch the next iteration's captured forward-backward before this one is validated.

Graph mode with the device-gated optimizer step leaves one host sync per iteration: the rerun
state machine's read of the in-graph checks. Between that read and the next launch the GPU idles
while the host runs the loop (+4-8% at the ``tiny`` preset). With a speculative launch the step,
once it has enqueued the gated optimizer replay, enqueues the *next* iteration's forward-backward
replay too, and only then lets the machine read: the GPU works through the read.

What keeps this exact (same results as without it):

- The read sees this pass's values: every attached ``ValidationBuffer`` is snapshotted
  (stream-ordered copy) before the next replay overwrites it, and that pass is begun ahead.
- Data: the next iteration's micro-batches are read ahead with ``RerunDataIterator.peek`` and
  served to it after ``advance``; a rerun of this iteration replays its own recorded batches.
- RNG: the state is captured before and after the speculative replay and put back to "before",
  so a rerun and the next iteration's saved state are unaffected; using the result restores
  "after", as if the replay had just run. A replay runs no Python, so only the device's default
  generator and the machine's extra generators can move: only those are captured (cheap: this
  runs every iteration on the host).
- A rejected pass skipped its optimizer step on the device, so the speculative replay ran on
  unstepped weights: it is discarded, never used. Anything else that calls the wrapper first
  (a rerun with this iteration's batches) discards it too: the result is used only when the
  next call reads exactly the peeked batch objects.

The step's ``zero_grad`` must be the graph's own (in place, inside the forward-backward): using a
launched result skips the call, so nothing may reset gradients in between.

Only launched when the training graph is captured (no Python runs in a replay) and error
injection is off (its per-pass device mask is set by the machine when a pass begins).

Limitation: with NCCL the machine's rank agreement is a device all-reduce, stream-ordered after
the launched replay, so on several GPUs the read waits for it and the overlap is mostly lost (the
results stay exact). An agreement over a gloo group, or reading the gate the graph already
max-reduces across ranks, would keep it; neither is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stalwart.graphs import FullIterationGraph, GraphMode, StagePhase
from stalwart.reliability.rerun import RerunDataIterator, ValidationBuffer
from stalwart.reliability.rerun.rng import RngStateTracker


@dataclasses.dataclass
class _Speculated:
    batches: list[Any]
    outputs: Any
    rng_after: tuple[torch.Tensor, dict[str, Any]]


class SpeculativeForwardBackward:
    """The step's ``forward_backward_func`` in graph mode, able to run one iteration ahead.

    Args:
        graph: the full-iteration graph (or any forward-backward function with its keyword
            signature and device-only effects).
        data_iterator: the training ``RerunDataIterator`` (peeked for the next iteration).
        buffers: the machine's validation buffers the graph writes.
        rng: the machine's extra generators (captured with the device's default one), or None.
        device: whose default generator the replay advances; default: ``graph``'s device, CPU
            for a plain function.
        ready: whether a launch may happen now; default: ``graph``'s training stage is
            captured (a replay runs no Python), True for a plain function.

    An evaluation call (``forward_only``) discards a pending launch.
    """

    def __init__(
        self,
        graph: FullIterationGraph | Callable[..., Any],
        data_iterator: RerunDataIterator[Any],
        buffers: Sequence[ValidationBuffer],
        rng: RngStateTracker | None = None,
        ready: Callable[[], bool] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if device is None:
            device = graph.device if isinstance(graph, FullIterationGraph) else torch.device("cpu")
        self._device = device
        if ready is None and isinstance(graph, FullIterationGraph):
            captured = graph

            def ready() -> bool:
                return captured.phase(GraphMode.TRAINING) is StagePhase.CAPTURED

        self._ready = ready or (lambda: True)
        self._graph = graph
        self._data = data_iterator
        self._buffers = list(buffers)
        self._rng = rng
        self._pending: _Speculated | None = None
        self.num_launched = 0
        self.num_used = 0

    def __call__(self, **kwargs: Any) -> Any:
        """Run a forward-backward, or hand out the speculative one launched for these batches."""
        pending, self._pending = self._pending, None
        if pending is None or kwargs.get("forward_only", False):
            return self._graph(**kwargs)
        num_microbatches = int(kwargs["num_microbatches"])
        batches = [next(kwargs["data_iterator"]) for _ in range(num_microbatches)]
        if len(batches) == len(pending.batches) and all(
            a is b for a, b in zip(batches, pending.batches)
        ):
            self._set_rng_state(pending.rng_after)
            self.num_used += 1
            return pending.outputs
        return self._graph(**dict(kwargs, data_iterator=iter(batches)))

    def launch_next(self, call_kwargs: dict[str, Any], num_microbatches: int) -> bool:
        """Replay the next iteration's forward-backward now (``call_kwargs``: this iteration's
        call without ``data_iterator``). Call after this pass's gated optimizer step was
        enqueued and joined, before the machine reads the pass. Returns whether it launched."""
        if not self._ready():
            return False
        batches = self._data.peek(num_microbatches)
        for buffer in self._buffers:
            buffer.snapshot()  # this pass's values, for the machine's read
            buffer.begin_ahead()  # the next pass's writes start clean
        rng_before = self._rng_state()
        outputs = self._graph(
            **dict(call_kwargs, data_iterator=iter(batches), num_microbatches=num_microbatches)
        )
        rng_after = self._rng_state()
        self._set_rng_state(rng_before)
        self._pending = _Speculated(list(batches), outputs, rng_after)
        self.num_launched += 1
        return True

    def _rng_state(self) -> tuple[torch.Tensor, dict[str, Any]]:
        extra = self._rng.capture() if self._rng is not None else {}
        if self._device.type == "cuda":
            return torch.cuda.get_rng_state(self._device), extra
        return torch.get_rng_state(), extra

    def _set_rng_state(self, state: tuple[torch.Tensor, dict[str, Any]]) -> None:
        device_state, extra = state
        if self._device.type == "cuda":
            torch.cuda.set_rng_state(device_state, self._device)
        else:
            torch.set_rng_state(device_state)
        if self._rng is not None and extra:
            self._rng.restore(extra)

    def discard(self) -> None:
        """Forget a pending speculative result (e.g. before evaluation); the next call runs."""
        self._pending = None
