"""Optimizer CUDA graph: gradient clipping and a capturable AdamW step replayed as one graph.

Graph-safe requirements, all checked by :class:`OptimizerGraph`:

* every param group is ``capturable=True`` (step counters live on the device, so replays advance
  them) and ``foreach=True``;
* every group's ``lr`` is a device tensor; :func:`set_learning_rate` writes it with ``fill_`` so
  an LR schedule takes effect under replay (a float LR would be frozen at capture);
* the gradient norm and clip coefficient stay on the device (:func:`grad_norm`,
  :func:`clip_coefficient`): no ``.item()``.

Warm-up: the first ``warmup_steps`` (>= 2) calls of :meth:`OptimizerGraph.step` are real eager
optimizer steps on the capture stream. They create the lazily-allocated Adam state (``exp_avg``,
``exp_avg_sq``, ``step``) at fixed addresses; the capture call then captures and replays, so every
call is exactly one real step and no snapshot/restore of parameters is needed.

Skipping without a host sync: with ``skip_gate`` (a float32 device scalar, 1.0 = skip) and fused
AdamW, the skip decision is made on the device. Fused AdamW honours the ``found_inf`` tensor that
AMP's GradScaler uses: when it is 1.0 the kernel leaves parameters and moments untouched and the
step counters are rolled back. The forward-backward graph writes the gate from its in-graph
checks, so :meth:`OptimizerGraph.step` with ``gated=True`` can be replayed *before* the host has
read those checks, on a second stream (``overlap=True``): the host's one validation read then
overlaps the optimizer instead of stalling the GPU between the two graphs.

Gradients are not zeroed here: with :class:`FullIterationGraph` ``grad_params`` the zeroing is
part of the forward-backward graph, which keeps ``.grad`` addresses fixed for this graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from stalwart.graphs.full_iteration import CaptureFailurePolicy, StagePhase
from stalwart.graphs.pool import GraphContext
from stalwart.log_notice import NOTICE

logger = logging.getLogger(__name__)

_CLIP_EPS = 1e-6


def make_capturable_adamw(
    params: Iterable[torch.Tensor] | Iterable[dict],
    *,
    lr: float,
    device: torch.device,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW ready for :class:`OptimizerGraph`: capturable, device-tensor LR.

    ``fused=False``: the foreach implementation; ``fused=True``: the single-kernel fused one
    (also capturable; fewer passes over the optimizer state).
    """
    return torch.optim.AdamW(
        params,
        lr=torch.tensor(lr, dtype=torch.float32, device=device),
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        capturable=True,
        foreach=None if fused else True,
        fused=True if fused else None,
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's LR; in place (``fill_``, no sync) when it is a tensor, as a graph needs."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class GradNormSource(Protocol):
    """Where the clip may find the global gradient norm already computed in this pass.

    :class:`stalwart.reliability.rerun.GradCheckState` is one: its gradient check after the
    backward computes exactly :func:`grad_norm` (same kernels, same order), so the clip need not
    read every gradient a second time.
    """

    def norm_of(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The norm of ``params``' gradients, bitwise what :func:`grad_norm` would return, as
        a device tensor the next pass overwrites; None when it was not computed for exactly
        these parameters in this order (the order of the sum decides the rounding)."""
        ...


def shared_norm(
    source: GradNormSource | None, params: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """``source.norm_of`` of the parameters that have gradients (None without a source)."""
    if source is None:
        return None
    return source.norm_of([p for p in params if p.grad is not None])


def grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients as a device tensor (foreach, no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ValueError("grad_norm: no parameter has a gradient")
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` on the device; NaN norm gives a NaN
    coefficient."""
    return torch.clamp(max_norm / (total_norm + _CLIP_EPS), max=1.0)


def clip_grads_(
    params: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm`` without a host sync; return the pre-clip norm.

    Always multiplies (by 1.0 when under the limit) so the captured kernel sequence is fixed.
    ``total``: the norm already computed (:class:`GradNormSource`); else it is computed.
    """
    total = grad_norm(params) if total is None else total
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, clip_coefficient(total, max_norm))
    return total


_CLIP_IN_STEP = "_stalwart_clip_in_step"  # marks a grad_scale installed by clip_in_optimizer_step


def clip_in_optimizer_step(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Let clipping ride on the fused Adam/AdamW step instead of a separate pass over the grads.

    Installs a float32 device scalar as the optimizer's ``grad_scale`` (the GradScaler API: the
    fused kernel divides every gradient by it as it reads it, and writes the divided gradient
    back). From then on :func:`clip_for_step` (used by :class:`OptimizerGraph`, the guarded
    step's eager optimizer and the optimizer inside the full-iteration graph) writes
    ``1 / clip_coefficient`` into it instead of multiplying the gradients: one read-modify-write
    of every gradient less per step (issue 19: ~0.25 ms per iteration at gpt2-124m on the H200).
    The norm is the same tensor as before; parameters agree with the separate clip to float32
    rounding (``g / (1 / c)`` instead of ``g * c``), and bitwise when no clipping happens (the
    scale is exactly 1.0). Composes with ``found_inf`` (a skipped step leaves everything alone).
    Call once, before any capture (the scalar's address is captured). Returns the scalar.

    Raises ``ValueError`` unless every param group is fused Adam/AdamW.

    Example::

        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        >>> scale = clip_in_optimizer_step(opt)
        >>> p.grad = torch.full((3,), 4.0)
        >>> clip_for_step(opt, [p], 1.0)  # the pre-clip norm; the step will divide by it
        tensor(6.9282)
        >>> opt.step(); round(float(p.grad.norm()), 4)  # the step left the clipped grads
        1.0
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # a framework's wrapper: the torch one
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or not all(
        g.get("fused", False) for g in inner.param_groups
    ):
        raise ValueError(
            "clipping inside the optimizer step (--clip-grad-in-optimizer) needs fused "
            f"Adam/AdamW (its grad_scale); got {type(inner).__name__} with fused="
            f"{[g.get('fused') for g in inner.param_groups]}"
        )
    device = inner.param_groups[0]["params"][0].device
    scale = torch.ones((), dtype=torch.float32, device=device)
    inner.grad_scale = scale  # type: ignore[attr-defined]
    setattr(inner, _CLIP_IN_STEP, scale)
    return scale


def clip_scale_of(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scalar :func:`clip_in_optimizer_step` installed (None: clipping is a separate pass)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    scale = getattr(inner, _CLIP_IN_STEP, None)
    return scale if scale is not None and getattr(inner, "grad_scale", None) is scale else None


def clip_for_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    max_norm: float,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip for the next ``optimizer.step()`` without a host sync; return the pre-clip norm.

    With :func:`clip_in_optimizer_step` installed the step's ``grad_scale`` gets
    ``1 / clip_coefficient`` (1.0 when ``max_norm`` is 0: no clipping); else the gradients are
    multiplied in place (:func:`clip_grads_`; nothing when ``max_norm`` is 0). ``total``: the
    norm already computed (:class:`GradNormSource`), returned as given; else it is computed.
    """
    total = grad_norm(params) if total is None else total
    scale = clip_scale_of(optimizer)
    if scale is not None:
        if max_norm > 0:
            scale.copy_(torch.reciprocal(clip_coefficient(total, max_norm)))
        else:
            scale.fill_(1.0)
    elif max_norm > 0:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, clip_coefficient(total, max_norm))
    return total


def check_skip_gate(optimizer: torch.optim.Optimizer, gate: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``gate`` can act as the optimizer's device-side skip flag."""
    if gate.dtype != torch.float32 or gate.numel() != 1:
        raise ValueError(
            f"skip_gate must be a one-element float32 tensor, got {gate.dtype} {tuple(gate.shape)}"
        )
    for index, group in enumerate(optimizer.param_groups):
        if not group.get("fused", False):
            raise ValueError(
                f"a device-side skip gate needs fused AdamW (it reads found_inf): param group "
                f"{index} has fused={group.get('fused')!r} (use make_capturable_adamw(fused=True))"
            )


def check_optimizer_graphable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` unless every param group can be captured and scheduled under replay."""
    for index, group in enumerate(optimizer.param_groups):
        if not group.get("capturable", False):
            raise ValueError(
                f"--optimizer-cuda-graph needs a capturable optimizer: param group {index} has "
                "capturable=False (use make_capturable_adamw or capturable=True)"
            )
        if not isinstance(group["lr"], torch.Tensor):
            raise ValueError(
                f"--optimizer-cuda-graph needs the learning rate as a device tensor: param group "
                f"{index} has lr={group['lr']!r}, which replay would freeze at its capture value"
            )


class OptimizerGraph:
    """Capture ``[clip_grads_ +] optimizer.step()`` once and replay it every iteration.

    ``step(lr)`` sets the LR (device ``fill_``), then runs eagerly (first ``warmup_steps`` calls),
    or captures + replays, or replays. It returns the pre-clip gradient norm as a static device
    tensor (overwritten by the next call) when ``clip_grad > 0``, else None.
    Skipping an iteration (rejected by validation) means simply not calling ``step``, or, with
    ``skip_gate``, letting the device skip it (``step(gated=True)``; see the module docstring).
    ``clip_params``: the parameters whose gradients are clipped, in the order their norms are
    summed (default: the optimizer's, group by group); ``grad_norm_source``
    (:class:`GradNormSource`): the clip takes the norm the forward-backward's gradient check
    already computed for exactly those parameters (captured as a read of its tensor).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        context: GraphContext,
        clip_grad: float = 0.0,
        warmup_steps: int = 2,
        on_capture_failure: CaptureFailurePolicy = CaptureFailurePolicy.FAIL,
        skip_gate: torch.Tensor | None = None,
        grad_norm_source: GradNormSource | None = None,
        clip_params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
            raise ValueError(
                f"optimizer graph warmup_steps must be an integer >= 2 (Adam state is created "
                f"lazily), got {warmup_steps!r}"
            )
        if clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {clip_grad!r}")
        check_optimizer_graphable(optimizer)
        if skip_gate is not None:
            check_skip_gate(optimizer, skip_gate)
            # torch's Adam/AdamW.step passes this attribute to the fused kernel (GradScaler API).
            optimizer.found_inf = skip_gate  # type: ignore[attr-defined]
        self.skip_gate = skip_gate
        self.grad_norm_source = grad_norm_source
        self.optimizer = optimizer
        self.clip_grad = float(clip_grad)
        self.warmup_steps = warmup_steps
        self.on_capture_failure = on_capture_failure
        self._context = context
        if clip_params is None:
            clip_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._params = [p for p in clip_params if p.requires_grad]
        self._graph: object | None = None
        self._norm: torch.Tensor | None = None
        self.phase = StagePhase.WARMUP
        self.num_eager = 0
        self.capture_seconds = 0.0
        self._overlapped = False  # the last step replayed on the context's second stream
        context.register(self)

    def step(
        self, lr: float | None = None, *, gated: bool = False, overlap: bool = False
    ) -> torch.Tensor | None:
        """One optimizer step (see class docstring).

        ``gated=False``: the host has decided to step; the skip gate (if any) is cleared first.
        ``gated=True``: the device decides from the gate the forward-backward wrote (needs
        ``skip_gate``). ``overlap=True``: replay on the context's second stream; call
        :meth:`join` before anything reads the parameters, gradients or the returned norm.
        Warm-up and capture calls never overlap.
        """
        if gated and self.skip_gate is None:
            raise ValueError("step(gated=True) needs the OptimizerGraph built with skip_gate")
        if lr is not None:
            set_learning_rate(self.optimizer, lr)
        if self.skip_gate is not None and not gated:
            self.skip_gate.zero_()
        self._overlapped = self.phase is StagePhase.CAPTURED and overlap
        if self.phase is StagePhase.CAPTURED:
            assert self._graph is not None
            if overlap:
                with self._context.overlapped():
                    self._graph.replay()  # type: ignore[attr-defined]
            else:
                self._graph.replay()  # type: ignore[attr-defined]
            return self._norm
        if self.phase is StagePhase.EAGER_FALLBACK or self.num_eager < self.warmup_steps:
            self.num_eager += 1
            with self._context.side_stream():
                return self._body()
        return self._capture()

    def _body(self) -> torch.Tensor | None:
        norm = None
        if self.clip_grad > 0:  # a separate pass, or the step's grad_scale (clip_in_optimizer_step)
            shared = shared_norm(self.grad_norm_source, self._params)
            norm = clip_for_step(self.optimizer, self._params, self.clip_grad, total=shared)
            if shared is not None:  # the next pass overwrites it; the caller logs this one
                norm = norm.clone()
        self.optimizer.step()
        return norm

    def _capture(self) -> torch.Tensor | None:
        graph = self._context.new_graph()
        start = time.perf_counter()
        try:
            with self._context.capture(graph):
                norm = self._body()
        except Exception as err:
            del graph
            if self.on_capture_failure is CaptureFailurePolicy.FAIL:
                raise RuntimeError(f"capture of the optimizer CUDA graph failed: {err}") from err
            logger.warning("optimizer graph capture failed (%s); stepping eagerly", err)
            self.phase = StagePhase.EAGER_FALLBACK
            with self._context.side_stream():
                return self._body()
        self.capture_seconds = time.perf_counter() - start
        self._graph, self._norm, self.phase = graph, norm, StagePhase.CAPTURED
        logger.info(
            "captured the optimizer CUDA graph in %.3f s", self.capture_seconds, extra=NOTICE
        )
        graph.replay()  # capture does not execute: replay so this call is a real step
        return norm

    def join(self) -> None:
        """Order the current stream after an overlapped step (device-side wait, no host sync)."""
        self._context.join_overlapped()

    def on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The stream the last :meth:`step` replayed on, made current (an overlapped step:
        the second stream), so a device timer's end event follows the step's work."""
        return self._context.on_overlap_stream() if self._overlapped else contextlib.nullcontext()

    def reset(self) -> None:
        """Drop the graph; the next ``step`` warms up (``warmup_steps`` eager steps) again."""
        self._graph = None
        self._norm = None
        self.phase = StagePhase.WARMUP
        self.num_eager = 0
