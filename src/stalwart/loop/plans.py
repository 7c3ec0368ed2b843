"""Plans: how the guarded step runs forward-backward and the optimizer step.

* :class:`EagerPlan`: micro-batches eagerly, the optimizer eagerly (gated on the device when the
  optimizer reads ``found_inf``).
* :class:`GraphPlan`: ``full_iteration`` captures the forward-backward of all micro-batches as one
  CUDA graph (checks included, writing the machine's buffer), ``optimizer_graph`` replays clip +
  AdamW as another (Megatron's ``--optimizer-cuda-graph``; it works with an eager
  forward-backward too), or ``optimizer_in_graph`` captures clip + fused AdamW inside the
  full-iteration graph itself (``stalwart.loop.optimizer_in_graph``). Graphs need CUDA;
  ``context`` lets CPU tests use a fake backend.

A plan is a small frozen description; the step calls :meth:`build` once with its parts and gets
the runners. There are no optional callables to plug in or reset per iteration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stalwart.graphs import FullIterationGraph, GraphContext, GraphMode, OptimizerGraph, StagePhase
from stalwart.loop.microbatches import NO_TIMERS, MicroBatches, Reported, with_means
from stalwart.loop.observer import NULL_OBSERVER
from stalwart.loop.optimizer import EagerOptimizer, GraphedOptimizer, OptimizerRunner
from stalwart.loop.optimizer_in_graph import InGraphOptimizer, around_passes, with_optimizer_step
from stalwart.observability.timer_split import make_phase_split

logger = logging.getLogger(__name__)

DDP_MIN_WARMUP_STEPS = 11  # torch docs: DDP needs 11 eager iterations before capture


def graph_warmup_steps(model: nn.Module, requested: int) -> int:
    """``--cuda-graph-warmup-steps``, raised to 11 for DDP.

    DDP's reducer still changes its host-side state (bucket rebuild, sampled runtime stats with
    event reads) in its first iterations; capturing before the 11th records a sync or a stale
    bucket layout (torch docs, "CUDA graphs: usage with DistributedDataParallel").
    """
    if isinstance(model, DistributedDataParallel) and requested < DDP_MIN_WARMUP_STEPS:
        logger.info(
            "--cuda-graph-warmup-steps %d raised to %d for DistributedDataParallel",
            requested,
            DDP_MIN_WARMUP_STEPS,
        )
        return DDP_MIN_WARMUP_STEPS
    return requested


@dataclass(frozen=True)
class PlanParts:
    """What a plan is built from (given by the step)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    micro_batches: MicroBatches
    eager_optimizer: EagerOptimizer
    clip_grad: float


@dataclass
class Runners:
    """A built plan.

    ``forward_backward(data_iterator=, num_microbatches=, first=, stop=)`` runs a pass (or, when
    ``splittable``, micro-batches ``[first, stop)`` of it); ``evaluate`` runs a forward-only pass;
    ``lookahead_ready()`` says whether the next iteration may be launched now (a graph: once
    captured, so a launch runs no Python); ``checks_eval_on_host``: evaluation losses are checked
    from their means (under a graph).
    """

    forward_backward: Callable[..., Reported]
    evaluate: Callable[..., Reported]
    optimizer: OptimizerRunner
    splittable: bool
    lookahead_ready: Callable[[], bool]
    checks_eval_on_host: bool = False
    close: Callable[[], None] = lambda: None
    capture_state: Callable[[], Hashable] = lambda: None  # changes when a graph is captured
    # A graph: load a pass's inputs now, return the call that runs it (the look-ahead queues
    # the next pass's input copies before the optimizer step, the replay after it).
    stage_pass: Callable[..., Callable[[], Reported]] | None = None


@dataclass(frozen=True)
class EagerPlan:
    """Everything eager (the default)."""

    def build(self, parts: PlanParts) -> Runners:
        return Runners(
            forward_backward=parts.micro_batches,
            evaluate=parts.micro_batches,
            optimizer=parts.eager_optimizer,
            splittable=True,
            lookahead_ready=lambda: True,
        )


@dataclass(frozen=True)
class GraphPlan:
    """CUDA graphs for the forward-backward (``full_iteration``) and/or the optimizer step.

    ``warmup_steps``: eager calls before capture (raised to 11 for DDP). ``context``: the graph
    pool and streams (default: a new :class:`stalwart.graphs.GraphContext` on the model's
    device). The optimizer graph needs a capturable optimizer with a device-tensor LR
    (:func:`stalwart.graphs.make_capturable_adamw`); with ``fused=True`` it is gated.
    ``optimizer_in_graph``: clip + the fused AdamW step inside the full-iteration graph instead
    (``optimizer_graph`` is then not used; no look-ahead launch: see
    ``stalwart.loop.optimizer_in_graph``). ``means_in_graph``: the reported values' means over
    the micro-batches are computed inside the full-iteration graph (``stalwart.loop.with_means``),
    not by host ops after every replay (the same values; off: the baseline of
    ``bench/host_overhead.py``).
    """

    full_iteration: bool = True
    optimizer_graph: bool = True
    warmup_steps: int = 3
    context: GraphContext | None = None
    optimizer_warmup_steps: int = 2  # eager steps before the optimizer graph is captured
    optimizer_in_graph: bool = False
    means_in_graph: bool = True

    def build(self, parts: PlanParts) -> Runners:
        device = parts.micro_batches.device
        context = self.context or GraphContext(device)
        if self.optimizer_in_graph:
            return self._build_in_graph(parts, context)
        fb: Callable[..., Reported] = replace(parts.micro_batches, zero_grad="in_place")
        evaluate: Callable[..., Reported] = parts.micro_batches
        graph: FullIterationGraph | None = None
        if self.full_iteration:
            # Inside the capture no host timer or dump hook may run; the step times the call.
            graph = FullIterationGraph(
                self._captured_pass(parts.micro_batches),
                context=context,
                warmup_steps=graph_warmup_steps(parts.model, self.warmup_steps),
                grad_params=parts.params,
            )
            fb = evaluate = graph
        optimizer: OptimizerRunner = parts.eager_optimizer
        optimizer_graph: OptimizerGraph | None = None
        if self.optimizer_graph:
            gate = parts.eager_optimizer.gate if parts.eager_optimizer.gated else None
            optimizer_graph = OptimizerGraph(
                parts.optimizer,
                context=context,
                clip_grad=parts.clip_grad,
                warmup_steps=self.optimizer_warmup_steps,
                skip_gate=gate,
                grad_norm_source=parts.eager_optimizer.norm_source,
                clip_params=parts.params,  # the eager step's order: the same norm, bitwise
            )
            optimizer = GraphedOptimizer(optimizer_graph)
        return Runners(
            forward_backward=fb,
            evaluate=evaluate,
            optimizer=optimizer,
            splittable=graph is None,
            lookahead_ready=_captured(graph),
            checks_eval_on_host=graph is not None,
            close=context.teardown,
            capture_state=_capture_state(graph, optimizer_graph),
            stage_pass=graph.stage if graph is not None else None,
        )

    def _build_in_graph(self, parts: PlanParts, context: GraphContext) -> Runners:
        """One graph: forward-backward of every micro-batch, checks, clip and the step."""
        eager = parts.eager_optimizer
        if not self.full_iteration:
            raise ValueError(
                "--cuda-graph-include-optimizer needs --cuda-graph-impl full_iteration "
                "(GraphPlan(full_iteration=True))"
            )
        if eager.loss_scaler.dynamic or eager.log_num_zeros:
            raise ValueError(
                "--cuda-graph-include-optimizer cannot be used with --fp16 dynamic loss scaling or "
                "--log-num-zeros-in-grad (both decide on the host before the step)"
            )
        optimizer = InGraphOptimizer(
            parts.optimizer,
            parts.params,
            clip_grad=parts.clip_grad,
            machine=parts.micro_batches.machine,
            gate=eager.gate,
            norm_source=eager.norm_source,
        )
        logger.info(
            "--cuda-graph-include-optimizer: one graph per iteration, and no speculative launch "
            "of the next iteration: the device idles while the host reads the checks and "
            "queues the next replay (on one GPU that costs more than a second graph; "
            "docs/benchmarks.md, the kernel floor's device idle table)"
        )
        split = make_phase_split(parts.micro_batches.timers)  # the timers' boundary event
        graph = FullIterationGraph(
            with_optimizer_step(self._captured_pass(parts.micro_batches), optimizer, split),
            context=context,
            warmup_steps=graph_warmup_steps(parts.model, self.warmup_steps),
            grad_params=parts.params,
        )
        return Runners(
            forward_backward=around_passes(graph, optimizer, split),
            evaluate=graph,
            optimizer=optimizer,
            splittable=False,
            lookahead_ready=lambda: False,  # a launch would contain its own optimizer step
            checks_eval_on_host=True,
            close=context.teardown,
            capture_state=_capture_state(graph, None),
        )

    def _captured_pass(self, micro_batches: MicroBatches) -> Callable[..., Reported]:
        captured = _capturable(micro_batches)
        return with_means(captured) if self.means_in_graph else captured


def _capturable(micro_batches: MicroBatches) -> MicroBatches:
    """The pass as a graph captures it: no host timers or dump hooks (they would sync, or be
    frozen at capture); straggler compute regions may stay (``graph_safe``)."""
    in_graph = micro_batches.observer.graph_safe()
    return replace(
        micro_batches,
        zero_grad="none",
        check_eval_losses=False,
        timers=NO_TIMERS,
        observer=in_graph if in_graph is not None else NULL_OBSERVER,
    )


def _capture_state(
    graph: FullIterationGraph | None, optimizer: OptimizerGraph | None
) -> Callable[[], Hashable]:
    """A value that changes whenever either graph captures (the goodput ledger's compile)."""

    def state() -> Hashable:
        fb = graph.num_captures if graph is not None else 0
        opt = (optimizer.phase, optimizer.capture_seconds) if optimizer is not None else None
        return fb, opt

    return state


def _captured(graph: FullIterationGraph | None) -> Callable[[], bool]:
    if graph is None:
        return lambda: True
    return lambda: graph.phase(GraphMode.TRAINING) is StagePhase.CAPTURED


Plan = EagerPlan | GraphPlan
__all__ = ["EagerPlan", "GraphPlan", "Plan", "PlanParts", "Runners", "graph_warmup_steps"]
