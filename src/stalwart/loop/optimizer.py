"""How the guarded step runs the optimizer: eagerly or as a CUDA graph, gated or host-decided.

*Gated*: the step is enqueued before the rerun machine has read the pass's checks; the optimizer
reads the machine's skip gate as ``found_inf`` and leaves parameters, moments and step counters
untouched on the device when a check failed. Clipping stays on the device too, so nothing waits
for the host. Supported by torch's fused Adam, AdamW, SGD and Adagrad (``fused=True``; each
reads ``found_inf``, checked on CPU with torch 2.13 and on CUDA with 2.11). Any other optimizer
(``foreach``, a third-party one) and fp16 with dynamic loss scaling fall back to the
*host-decided* step: it runs after the read, only for an accepted pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from stalwart.graphs import (
    GradNormSource,
    OptimizerGraph,
    clip_for_step,
    clip_grads_,
    clip_scale_of,
    shared_norm,
)
from stalwart.loop.microbatches import NO_TIMERS, StepTimers
from stalwart.loop.precision import NullLossScaler
from stalwart.observability.timer_names import (
    OPTIMIZER_CLIP_MAIN_GRAD,
    OPTIMIZER_COUNT_ZEROS,
    OPTIMIZER_INNER_STEP,
)

_GATEABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Lightning's ``LightningOptimizer``,
    Accelerate's ``AcceleratedOptimizer``: both expose it as ``.optimizer``), else ``optimizer``.
    The wrapper's ``step`` runs the inner one's, which is the one that reads ``found_inf``."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips itself on the device when ``found_inf`` is 1.0 (every group
    fused, a torch optimizer that passes ``found_inf`` to its fused kernel; wrappers unwrapped)."""
    inner = innermost(optimizer)
    return isinstance(inner, _GATEABLE) and all(g.get("fused", False) for g in inner.param_groups)


def grad_norm_and_clip(
    parameters: list[nn.Parameter],
    clip_grad: float,
    optimizer: torch.optim.Optimizer | None = None,
    norm_source: GradNormSource | None = None,
) -> torch.Tensor:
    """Global L2 norm of the gradients (device tensor); clip to ``clip_grad`` when > 0.

    When ``optimizer`` carries :func:`stalwart.graphs.clip_in_optimizer_step`'s scale, the clip
    factor goes into it (the fused step divides the gradients as it reads them) instead of a
    separate pass; the norm is computed the same way (``torch._foreach_norm``, then the norm of
    the norms), so the logged value is unchanged. ``norm_source``: the norm the gradient check
    already computed is used (the same value, bitwise) and the returned norm is its copy.
    """
    with_grads = [p for p in parameters if p.grad is not None]
    shared = shared_norm(norm_source, with_grads) if with_grads else None
    if optimizer is not None and with_grads and clip_scale_of(innermost(optimizer)) is not None:
        norm = clip_for_step(innermost(optimizer), with_grads, clip_grad, total=shared)
        return norm if shared is None else norm.clone()
    if shared is not None:
        # torch's clip_grad_norm_ without its norm pass: the same coefficient and multiply;
        # no multiply at all without clipping (it would multiply by exactly 1.0).
        if clip_grad > 0:
            clip_grads_(with_grads, clip_grad, total=shared)
        return shared.clone()  # the next pass's check overwrites ``shared``
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a replicated DTensor
    return full_tensor() if callable(full_tensor) else norm


def count_zeros(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Number of exactly-zero gradient entries (device tensor, ``--log-num-zeros-in-grad``)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.stack([(g == 0).sum() for g in grads]).sum()


@dataclass(eq=False)
class Stepped:
    """What one optimizer step produced (device tensors; no sync)."""

    grad_norm: torch.Tensor | None
    num_zeros: torch.Tensor | None = None
    skipped: bool = False


class OptimizerRunner(Protocol):
    """The optimizer half of a plan."""

    gated: bool  # can step before the read, skipping itself on the device

    def step(self, *, gated: bool, overlap: bool = True) -> Stepped: ...

    def join(self) -> None: ...

    def on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The stream the last step ran on made current (a device timer's end event is
        recorded there: an overlapped step runs on a second stream)."""
        ...

    def close(self) -> None: ...


@dataclass(eq=False, repr=False)  # object's repr: a dataclass's would print every parameter
class EagerOptimizer:
    """Clip + ``optimizer.step()`` eagerly; gated on the machine's skip gate when possible.

    ``gate`` is kept only where the optimizer reads it (:func:`reads_found_inf`), and
    ``norm_source`` only without loss scaling.
    """

    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    _: KW_ONLY
    clip_grad: float
    gate: torch.Tensor | None
    loss_scaler: NullLossScaler
    log_num_zeros: bool = False
    timers: StepTimers = NO_TIMERS
    norm_source: GradNormSource | None = None
    gated: bool = field(init=False)

    def __post_init__(self) -> None:
        # The check's norm is of the gradients as the backward left them: with loss scaling the
        # clip sees them unscaled, so it computes its own.
        if self.loss_scaler.dynamic or self.loss_scaler.scale != 1.0:
            self.norm_source = None
        if self.gate is not None and not reads_found_inf(self.optimizer):
            self.gate = None
        dynamic = self.loss_scaler.dynamic
        self.gated = self.gate is not None and not dynamic and not self.log_num_zeros
        if self.gate is not None:
            # torch's fused optimizers read this attribute (the GradScaler API): 1.0 = skip.
            innermost(self.optimizer).found_inf = self.gate  # type: ignore[attr-defined]

    def step(self, *, gated: bool, overlap: bool = True) -> Stepped:
        """``gated``: the device decides from the gate (before the read); otherwise the host
        decided to step and the gate is cleared first. ``overlap`` is for graphed steps."""
        if not gated and self.gate is not None:
            self.gate.zero_()
        found_inf = None if gated else self.loss_scaler.unscale_and_check(self.params)
        self.timers(OPTIMIZER_CLIP_MAIN_GRAD).start()
        norm = grad_norm_and_clip(self.params, self.clip_grad, self.optimizer, self.norm_source)
        self.timers(OPTIMIZER_CLIP_MAIN_GRAD).stop()
        zeros = None
        if self.log_num_zeros:
            self.timers(OPTIMIZER_COUNT_ZEROS).start()
            zeros = count_zeros(self.params)
            self.timers(OPTIMIZER_COUNT_ZEROS).stop()
        skipped = False
        if found_inf is not None:
            # Deliberate sync (fp16 dynamic loss scaling only): an overflow skips the step.
            skipped = bool(found_inf.item() > 0)
            self.loss_scaler.update(skipped)
        if not skipped:
            self.timers(OPTIMIZER_INNER_STEP).start()
            self.optimizer.step()
            self.timers(OPTIMIZER_INNER_STEP).stop()
        return Stepped(norm, zeros, skipped)

    def join(self) -> None:
        """Nothing to join: the eager step runs on the current stream."""

    def on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the current stream

    def close(self) -> None:
        pass


class GraphedOptimizer:
    """Clip + step replayed as one CUDA graph (:class:`stalwart.graphs.OptimizerGraph`); the gated
    step replays on a second stream, overlapping the machine's read."""

    def __init__(self, graph: OptimizerGraph) -> None:
        self.graph = graph
        self.gated = graph.skip_gate is not None

    def step(self, *, gated: bool, overlap: bool = True) -> Stepped:
        """A gated step replays on the second stream (``overlap``) unless told not to: when
        the next replay is queued right after it, the two-stream handoff only adds waits."""
        return Stepped(self.graph.step(gated=gated, overlap=gated and overlap))

    def join(self) -> None:
        self.graph.join()

    def on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        return self.graph.on_step_stream()

    def close(self) -> None:
        self.graph.reset()
