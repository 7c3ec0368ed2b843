"""The optimizer step captured inside the full-iteration CUDA graph
(``GraphPlan(optimizer_in_graph=True)``).

One graph replays forward-backward of every micro-batch, the checks, the skip gate, gradient
clipping and a fused capturable AdamW step: one launch per iteration instead of two, and no
separate optimizer graph. Measured with a plain-PyTorch copy of the reference model on the H200
(fused in the graph vs foreach in its own): -3.2% per iteration at gpt2-124m, -6.6% at small.

The step reads ``step_gate = max(the machine's skip gate, hold)`` as ``found_inf``. ``hold`` is a
device scalar the host sets before each pass (a ``fill_``, no sync):

* 0 in an initial pass once the machine has shown that every check has a device verdict
  (``RerunStateMachine.can_gate_step`` after the first pass): the graph's step is the gated step
  the guarded step would have enqueued, skipped on the device exactly when the read rejects;
* 1 otherwise (the first pass, rerun passes, determinism statistics, checks evaluated on the
  host): the graph's clip and step leave gradients and parameters untouched, and the step runs
  eagerly after the pass, gated or host-decided as usual.

The first pass also materialises the optimizer state before any capture (a step skipped on the
device creates it). No look-ahead: the next iteration's replay would contain its own optimizer
step, which a discarded launch could not undo; the machine's read follows the replay.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stalwart.graphs import (
    GradNormSource,
    check_optimizer_graphable,
    clip_coefficient,
    clip_scale_of,
    grad_norm,
    shared_norm,
)
from stalwart.loop.microbatches import Reported
from stalwart.loop.optimizer import Stepped, grad_norm_and_clip, reads_found_inf
from stalwart.observability.timer_split import NoSplit, PhaseSplit
from stalwart.reliability.rerun import RerunStateMachine

logger = logging.getLogger(__name__)

NO_SPLIT = NoSplit()


class InGraphOptimizer:
    """The optimizer half of a plan whose graph holds the step (see the module docstring).

    Args:
        optimizer: fused, capturable, with device-tensor LRs
            (``make_capturable_adamw(fused=True)``).
        params: the parameters with gradients (the step's clipping set).
        clip_grad: global gradient-norm clip (0: none; the norm is still computed).
        machine: the rerun machine (whether a pass may be gated on the device).
        gate: the machine's skip gate (None: no checks, nothing gates the step).
        norm_source: where the pass's gradient check left the norm (the clip then reuses it).
    """

    gated = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        *,
        clip_grad: float,
        machine: RerunStateMachine,
        gate: torch.Tensor | None,
        norm_source: GradNormSource | None = None,
    ) -> None:
        check_optimizer_graphable(optimizer)
        if not reads_found_inf(optimizer):
            raise ValueError(
                "the optimizer step inside the full-iteration graph (--cuda-graph-include-"
                "optimizer) needs a fused optimizer that reads found_inf (fused AdamW: "
                "make_capturable_adamw(fused=True))"
            )
        device = params[0].device
        self.optimizer, self.params, self.clip_grad = optimizer, params, float(clip_grad)
        self.machine, self.gate = machine, gate
        self.norm_source = norm_source
        self.step_gate = torch.zeros((), dtype=torch.float32, device=device)
        self.hold = torch.ones((), dtype=torch.float32, device=device)
        # torch's fused Adam/AdamW read this attribute (the GradScaler API): 1.0 = skip.
        optimizer.found_inf = self.step_gate  # type: ignore[attr-defined]
        self._verified = False  # the machine gates every check of an initial pass on the device
        self._in_pass = False  # this pass's step is the graph's
        self._warned = False
        self._norm: torch.Tensor | None = None

    # ------------------------------------------------------------------ around each pass
    def before_pass(self) -> None:
        """Decide (host) whether this pass's step is the graph's; set ``hold`` on the device."""
        self._in_pass = self._verified and self.machine.allows_step_before_validation()
        self.hold.fill_(0.0 if self._in_pass else 1.0)

    def in_graph_step(self) -> None:
        """Clip + step after the forward-backward, inside the graph (device work only)."""
        held = self.hold > 0
        gate = self.hold if self.gate is None else torch.maximum(self.gate, self.hold)
        self.step_gate.copy_(gate)
        shared = shared_norm(self.norm_source, self.params)
        # A copy of the check's norm: the step's norm is read after the next pass overwrote it.
        norm = grad_norm(self.params) if shared is None else shared.clone()
        if self.clip_grad > 0:
            coefficient = torch.where(
                held, torch.ones_like(norm), clip_coefficient(norm, self.clip_grad)
            )
            scale = clip_scale_of(self.optimizer)
            if scale is not None:  # clip_in_optimizer_step: the fused step divides by it
                scale.copy_(torch.reciprocal(coefficient))
            else:
                grads = [p.grad for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, coefficient)
        self.optimizer.step()
        self._norm = norm

    def after_pass(self) -> None:
        """Check the decision against the machine; verify the first initial pass."""
        can_gate = self.machine.can_gate_step()
        if self._in_pass and not can_gate:
            raise RuntimeError(
                "the optimizer step ran inside the full-iteration graph, but a check of this pass "
                "needs the host to decide (a check without a device verdict): drop "
                "--cuda-graph-include-optimizer (GraphPlan(optimizer_in_graph=False))"
            )
        if self._verified or not self.machine.allows_step_before_validation():
            return
        if can_gate:
            self._verified = True
            self._materialize_state()
        elif not self._warned:
            self._warned = True
            logger.warning(
                "a check has no device verdict: the optimizer step runs after the pass, not "
                "inside the full-iteration graph"
            )

    def _materialize_state(self) -> None:
        """Create the optimizer state before any capture: a step skipped on the device."""
        if all(p in self.optimizer.state for p in self.params if p.grad is not None):
            return
        self.step_gate.fill_(1.0)
        self.optimizer.step()

    # ------------------------------------------------------------------ OptimizerRunner
    @property
    def stepped_in_pass(self) -> bool:
        """This pass's step ran inside the graph: :meth:`step` does no work (the step's
        timer is not run for it: in EVENTS mode its device time reaches ``optimizer`` from
        the replay's split, ``stalwart.observability.timer_split``)."""
        return self._in_pass

    def step(self, *, gated: bool, overlap: bool = True) -> Stepped:
        """The graph's step (``gated``: it was enqueued with the pass), or an eager one when
        this pass held it: gated on the device, or host-decided (the gate cleared)."""
        if self._in_pass:
            if not gated:
                raise RuntimeError(
                    "a host-decided optimizer step after the full-iteration graph already ran it"
                )
            return Stepped(self._norm)
        if gated and self.gate is not None:
            self.step_gate.copy_(self.gate)
        else:
            self.step_gate.zero_()
        norm = grad_norm_and_clip(self.params, self.clip_grad, self.optimizer, self.norm_source)
        self.optimizer.step()
        return Stepped(norm)

    def join(self) -> None:
        """Nothing to join: the step is on the pass's stream."""

    def on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the pass's stream

    def close(self) -> None:
        pass


def with_optimizer_step(
    forward_backward: Callable[..., Reported],
    optimizer: InGraphOptimizer,
    split: PhaseSplit = NO_SPLIT,
) -> Callable[..., Reported]:
    """The captured function: a pass, then (training only) the optimizer step, bracketed by
    ``split``'s events (the boundary between the two timers' parts; recorded in the capture)."""

    def body(**kwargs: Any) -> Reported:
        reported = forward_backward(**kwargs)
        if not kwargs.get("forward_only", False):
            region = split.begin()
            optimizer.in_graph_step()
            split.end(region)
        return reported

    return body


def around_passes(
    graph: Callable[..., Reported], optimizer: InGraphOptimizer, split: PhaseSplit = NO_SPLIT
) -> Callable[..., Reported]:
    """The plan's training pass: decide ``hold``, replay (or warm up, capture), check; the
    pass's optimizer part moves from ``forward-backward`` to ``optimizer`` (``split``)."""

    def forward_backward(**kwargs: Any) -> Reported:
        optimizer.before_pass()
        split.before_pass()
        reported = graph(**kwargs)
        split.after_pass()
        optimizer.after_pass()
        return reported

    return forward_backward
