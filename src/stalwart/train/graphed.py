"""Full-iteration CUDA graphs for the reference trainer (``--cuda-graph-impl full_iteration``).

The forward-backward of all micro-batches is one captured graph; with ``--optimizer-cuda-graph``
the clip + AdamW step is another (shared pool and capture stream). Validation goes beyond
Megatron, which turns its NaN checks off under full-iteration graphs: the rerun state machine's
loss and gradient checks are recorded into a static :class:`ValidationBuffer` *inside* the graph,
and the machine reads it in its one per-iteration sync after the replay. A rerun replays the
forward-backward graph on the same micro-batches (the rerun data iterator hands them to the
graph's static buffers again).

With ``--optimizer-cuda-graph`` the rejection itself is also decided on the device: the graph ends
by writing a skip gate (any recorded check non-finite, max-reduced across data-parallel ranks) that
fused AdamW reads as ``found_inf``. The step can then replay the optimizer graph on a second
stream *before* the machine's host read, which overlaps it instead of stalling the GPU between the
two graphs; a rejected iteration's optimizer replay leaves parameters and moments untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stalwart.config.run import RunConfig
from stalwart.distributed.process_group import DistributedContext
from stalwart.graphs import (
    CudaGraphImpl,
    FullIterationGraph,
    GraphContext,
    GraphSettings,
    OptimizerGraph,
    RecomputeGranularity,
    check_graph_config,
)
from stalwart.models.recompute import SELECTIVE_RECOMPUTE_MODULES
from stalwart.reliability.rerun import (
    GRAD_TOLERANCE,
    INF_GRAD_MESSAGE,
    INF_LOSS_MESSAGE,
    NAN_GRAD_MESSAGE,
    NAN_LOSS_MESSAGE,
    RerunConfig,
    RerunDataIterator,
    RerunStateMachine,
    ValidationBuffer,
    check_loss,
    local_grad_norm,
)
from stalwart.train.forward_step import GPTForwardStep
from stalwart.train.speculative import SpeculativeForwardBackward
from stalwart.train.step import StepParts, forward_backward

logger = logging.getLogger(__name__)


INPROCESS_NCCL_GRAPHS_MESSAGE = (
    "--inprocess-restart with --cuda-graph-impl full_iteration on {world_size} GPUs is not "
    "supported: the CUDA graphs hold the NCCL collectives they captured, and aborting the "
    "communicator did not return on two H200s even with the graphs released first. Recover "
    "graphed multi-GPU jobs with torchrun restarts (--max-restarts), or drop one of the flags"
)


def check_inprocess_with_graphs(config: RunConfig, device_type: str, world_size: int) -> None:
    """Refuse in-process restart of a graphed NCCL job (ValueError); one rank or CPU is fine.

    Measured on two H200s: the abort hung in ``_abort_process_group`` on both ranks, also with the
    graphs released first (upstream: pytorch/pytorch#115388).
    """
    if (
        config.inprocess.inprocess_restart
        and config.graphs.cuda_graph_impl == "full_iteration"
        and device_type == "cuda"
        and world_size > 1
    ):
        raise ValueError(INPROCESS_NCCL_GRAPHS_MESSAGE.format(world_size=world_size))


def check_graph_flags(config: RunConfig, device: torch.device, world_size: int = 1) -> None:
    """Reject invalid graph/recompute/validation combinations before training (ValueError)."""
    check_inprocess_with_graphs(config, device.type, world_size)
    g = config.graphs
    check_graph_config(
        GraphSettings(
            device=device,
            cuda_graph_impl=CudaGraphImpl(g.cuda_graph_impl),
            cuda_graph_warmup_steps=g.cuda_graph_warmup_steps,
            optimizer_cuda_graph=g.optimizer_cuda_graph,
            recompute_granularity=config.model.recompute_granularity,
            recompute_modules=(
                SELECTIVE_RECOMPUTE_MODULES
                if config.model.recompute_granularity is RecomputeGranularity.SELECTIVE
                else ()
            ),
            hidden_dropout=config.model.dropout,
            attention_dropout=config.model.dropout,
            check_for_nan_in_loss_and_grad=config.rerun.check_for_nan_in_loss_and_grad,
            check_for_spiky_loss=config.rerun.check_for_spiky_loss,
            check_for_large_grads=config.rerun.check_for_large_grads,
            log_num_zeros_in_grad=config.log.log_num_zeros_in_grad,
            fp16=config.training.fp16,
            compile=config.training.compile,
        )
    )


class GraphValidation:
    """Loss/grad NaN-Inf checks written into a :class:`ValidationBuffer` (graph-capturable).

    Slots are declared up front: one NaN and one Inf slot per micro-batch loss and for the local
    gradient norm. ``record_loss`` is called by the forward step once per micro-batch; the Python
    counter only runs during warm-up and capture, the recorded device writes replay.
    """

    def __init__(
        self,
        device: torch.device,
        num_microbatches: int,
        enabled: bool,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.buffer = ValidationBuffer(
            device, name="full_iteration", capacity=4 * num_microbatches + 4
        )
        self.enabled = enabled
        # 1.0 when any check of the pass failed on any rank (fused AdamW's found_inf).
        self.skip_gate = torch.zeros((), dtype=torch.float32, device=device)
        self._group = group
        self._loss_slots: list[tuple[int, int]] = []
        self._grad_slots: tuple[int, int] | None = None
        if enabled:
            for _ in range(num_microbatches):
                nan = self.buffer.add_check(NAN_LOSS_MESSAGE, torch.isnan)
                inf = self.buffer.add_check(INF_LOSS_MESSAGE, torch.isinf)
                self._loss_slots.append((nan, inf))
            nan = self.buffer.add_check(NAN_GRAD_MESSAGE, torch.isnan, tolerance=GRAD_TOLERANCE)
            inf = self.buffer.add_check(INF_GRAD_MESSAGE, torch.isinf, tolerance=GRAD_TOLERANCE)
            self._grad_slots = (nan, inf)
        self._index = 0

    def begin_pass(self) -> None:
        self._index = 0

    def record_loss(self, loss: torch.Tensor) -> None:
        if not self.enabled:
            return
        nan, inf = self._loss_slots[self._index % len(self._loss_slots)]
        self.buffer.record(nan, loss)
        self.buffer.record(inf, loss)
        self._index += 1

    def record_grads(self, params: list[nn.Parameter]) -> None:
        if self._grad_slots is None:
            return
        norm = local_grad_norm(params)
        self.buffer.record(self._grad_slots[0], norm)
        self.buffer.record(self._grad_slots[1], norm)

    def update_skip_gate(self) -> None:
        """Device-side rejection: every in-graph check rejects exactly non-finite values, so the
        gate is set iff the machine's host read will reject (on some rank; hence the max)."""
        if not self.enabled:
            return
        values = self.buffer.values[: len(self.buffer.specs)]
        self.skip_gate.copy_((~torch.isfinite(values)).any())
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.all_reduce(self.skip_gate, op=dist.ReduceOp.MAX, group=self._group)


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


def check_eval_losses(
    rerun: RerunStateMachine, losses: dict[str, float], config: RerunConfig
) -> None:
    """NaN/Inf checks of the evaluation means, with the machine's disabled-mode semantics.

    Under the evaluation graph a per-micro-batch host check would run at capture only; a NaN/Inf
    in any micro-batch propagates into the mean, which evaluation reads anyway, so the same
    fatal check (RuntimeError) runs on it at no extra sync.
    """
    with rerun.disabled():
        for value in losses.values():
            check_loss(rerun, torch.tensor(value, dtype=torch.float64), config)


@dataclass
class GraphParts:
    """What the step uses instead of the eager pieces when graphs are on."""

    context: GraphContext
    forward_backward: FullIterationGraph
    validation: GraphValidation
    optimizer_graph: OptimizerGraph | None

    def teardown(self) -> None:
        """Free the graphs and their pool (in-process restart, end of training)."""
        self.context.teardown()


def build_graph_parts(
    config: RunConfig,
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rerun: RerunStateMachine,
    num_microbatches: int,
    dp_group: dist.ProcessGroup | None = None,
) -> GraphParts:
    """Graph context, the full-iteration graph (+ optimizer graph) and in-graph validation."""
    params = [p for p in model.parameters() if p.requires_grad]
    context = GraphContext(device)
    validation = GraphValidation(
        device, num_microbatches, config.rerun.check_for_nan_in_loss_and_grad, dp_group
    )
    rerun.attach_buffer(validation.buffer)

    def graphed_forward_backward(**kwargs: Any) -> list[dict[str, torch.Tensor]]:
        if kwargs.get("forward_only", False):  # the evaluation graph: checked on the host
            return forward_backward(**kwargs)
        validation.begin_pass()
        reported = forward_backward(**kwargs)
        validation.record_grads(params)
        validation.update_skip_gate()
        return reported

    fb = FullIterationGraph(
        graphed_forward_backward,
        context=context,
        warmup_steps=graph_warmup_steps(model, config.graphs.cuda_graph_warmup_steps),
        grad_params=params,
    )
    opt_graph = None
    if config.graphs.optimizer_cuda_graph:
        gated = validation.enabled and all(g.get("fused") for g in optimizer.param_groups)
        opt_graph = OptimizerGraph(
            optimizer,
            context=context,
            clip_grad=config.optim.clip_grad,
            skip_gate=validation.skip_gate if gated else None,
        )
    return GraphParts(context, fb, validation, opt_graph)


def use_graphs(
    config: RunConfig,
    ctx: DistributedContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rerun: RerunStateMachine,
    forward_step: GPTForwardStep,
    step_parts: StepParts,
    train_iterator: RerunDataIterator[Any],
) -> tuple[Callable[[], None], SpeculativeForwardBackward | None]:
    """Switch the step to the full-iteration graph (+ optimizer graph); returns the teardown
    and the speculative launcher (gated optimizer graph and the flag on), else None."""
    group = dist.group.WORLD if ctx.is_distributed else None
    parts = build_graph_parts(
        config, ctx.device, model, optimizer, rerun, step_parts.num_microbatches, group
    )
    forward_step.loss_check = parts.validation.record_loss  # in-graph validation
    step_parts.forward_backward_func = parts.forward_backward
    step_parts.after_backward = None  # gradient checks are recorded inside the graph
    step_parts.zero_grad = lambda: None  # the graph zeroes grads in place (fixed addresses)
    step_parts.time_inside_schedule = False
    opt_graph = parts.optimizer_graph
    if opt_graph is not None:
        # The LR scheduler fills the device-tensor LR in place; clip + step replay as one graph.
        step_parts.clip_and_step = lambda params, clip_grad: opt_graph.step()
        if opt_graph.skip_gate is not None:
            # Replayed before the validation read, on a second stream; skips itself if rejected.
            step_parts.gated_step = lambda: opt_graph.step(gated=True, overlap=True)
            step_parts.join_gated_step = opt_graph.join
    speculation = None
    if step_parts.gated_step is not None and config.graphs.cuda_graph_speculative_launch:
        speculation = SpeculativeForwardBackward(
            parts.forward_backward, train_iterator, [parts.validation.buffer], rerun.rng
        )
        step_parts.forward_backward_func = speculation  # evaluation calls discard a launch
    return parts.teardown, speculation
