"""One training iteration as a composition of small pieces.

``forward_backward`` runs the micro-batch schedule (gradient accumulation) with a Megatron-style
call signature, so a CUDA-graph wrapper can capture it whole. ``train_step`` wraps it in the rerun
state machine's protocol (run, validate, maybe replay), asks the machine whether to exit, and only
then clips and steps the optimizer: a rejected iteration never touches the parameters.

Host syncs: none here on the normal path. The rerun state machine reads its device-side checks
once per iteration inside ``should_run_forward_backward``; fp16 reads its overflow flag once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from stalwart.observability.timers import (
    BACKWARD_COMPUTE,
    FORWARD_BACKWARD,
    FORWARD_COMPUTE,
    OPTIMIZER,
    OPTIMIZER_CLIP_MAIN_GRAD,
    OPTIMIZER_COUNT_ZEROS,
    OPTIMIZER_INNER_STEP,
    NullTimer,
    Timers,
)
from stalwart.train.precision import NullLossScaler

ForwardStepFunc = Callable[[Iterator[dict[str, torch.Tensor]], nn.Module], dict[str, torch.Tensor]]


class RerunProtocol(Protocol):
    """The part of :class:`stalwart.reliability.rerun.RerunStateMachine` the step uses."""

    def should_run_forward_backward(self, data_iterator: Any) -> bool: ...

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]: ...

    def allows_step_before_validation(self) -> bool: ...


def _no_sync(model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager[Any]:
    """Reduce gradients only on the last micro-batch: DDP's ``no_sync`` or FSDP2's
    ``set_requires_gradient_sync`` (which keeps unsharded gradients until the last backward)."""
    if hasattr(model, "no_sync"):
        return model.no_sync() if not is_last else contextlib.nullcontext()  # type: ignore[operator]
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(set_sync):
        return _fsdp2_sync(set_sync, is_last)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_sync(set_sync: Callable[[bool], None], is_last: bool) -> Iterator[None]:
    set_sync(is_last)
    try:
        yield
    finally:
        set_sync(True)


def forward_backward(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: nn.Module,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    forward_only: bool = False,
    loss_scaler: NullLossScaler | None = None,
    timers: Timers | None = None,
    observer: Any = None,
) -> list[dict[str, torch.Tensor]]:
    """Run ``num_microbatches`` forward (and backward) passes, accumulating gradients.

    Megatron-compatible signature (``seq_length``/``micro_batch_size`` are accepted for wrappers
    that size static buffers). ``forward_step_func(data_iterator, model)`` returns a dict whose
    ``"loss"`` entry is backpropagated (divided by ``num_microbatches`` so gradients are a mean)
    and whose other entries are detached values to report.

    Returns:
        One dict of detached reported values per micro-batch (device tensors, no host sync).
    """
    del seq_length, micro_batch_size
    scaler = loss_scaler or NullLossScaler()
    timers = timers or _NULL_TIMERS
    forward_timer, backward_timer = timers(FORWARD_COMPUTE), timers(BACKWARD_COMPUTE)
    reported: list[dict[str, torch.Tensor]] = []
    for index in range(num_microbatches):
        is_last = index == num_microbatches - 1
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        if observer is not None:
            observer.on_microbatch(index, is_last)
        compute = observer.compute() if observer is not None else contextlib.nullcontext()
        with grad_mode, _no_sync(model, is_last or forward_only), compute:
            forward_timer.start()
            output = forward_step_func(data_iterator, model)
            forward_timer.stop()
            if not forward_only:
                backward_timer.start()
                scaler.scale_loss(output["loss"] / num_microbatches).backward()
                backward_timer.stop()
        reported.append({k: v.detach() for k, v in output.items()})
    return reported


class _NoTimers:
    """Stateless stand-in when no ``Timers`` is passed: every name is a no-op timer."""

    _timer = NullTimer()

    def __call__(self, name: str, log_level: int | None = None) -> NullTimer:
        del name, log_level
        return self._timer


_NULL_TIMERS: Any = _NoTimers()


def average_reported(
    reported: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Mean over micro-batches and data-parallel ranks of every reported value except ``loss``.

    One all-reduce of a stacked device tensor (asynchronous on NCCL: no host sync).
    """
    keys = [k for k in reported[0] if k != "loss"] or ["loss"]
    stacked = torch.stack([torch.stack([r[k].float() for r in reported]).mean() for k in keys])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
        stacked = stacked / dist.get_world_size(group)
    return {k: stacked[i] for i, k in enumerate(keys)}


def grad_norm_and_clip(parameters: list[nn.Parameter], clip_grad: float) -> torch.Tensor:
    """Global L2 norm of the gradients (device tensor); clip to ``clip_grad`` when > 0."""
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a replicated DTensor
    return full_tensor() if callable(full_tensor) else norm


def count_zeros(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Number of exactly-zero gradient entries (device tensor, ``--log-num-zeros-in-grad``)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.stack([(g == 0).sum() for g in grads]).sum()


def params_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all parameters (device tensor, ``--log-params-norm``)."""
    norms = torch._foreach_norm([p.detach() for p in parameters])
    return torch.linalg.vector_norm(torch.stack(norms))


@dataclass
class StepResult:
    """What one iteration produced. Tensors stay on the device; nothing here forced a sync."""

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norm: torch.Tensor | None = None
    num_zeros: torch.Tensor | None = None
    skipped: bool = False
    should_checkpoint: bool = False
    should_exit: bool = False
    exit_code: int = 0


@dataclass
class StepParts:
    """The collaborators of a training step, built once by the trainer."""

    model: nn.Module
    optimizer: Optimizer
    forward_step_func: ForwardStepFunc
    num_microbatches: int
    clip_grad: float
    loss_scaler: NullLossScaler
    rerun: RerunProtocol
    forward_backward_func: Callable[..., list[dict[str, torch.Tensor]]] = forward_backward
    optimizer_step: Callable[[], None] | None = None
    log_num_zeros: bool = False
    dp_group: dist.ProcessGroup | None = None
    after_backward: Callable[[], None] | None = None
    # Graph mode: grads are zeroed inside the captured iteration (fixed addresses), and clip +
    # optimizer step may be one captured graph returning the pre-clip norm.
    zero_grad: Callable[[], None] | None = None
    clip_and_step: Callable[[list[nn.Parameter], float], torch.Tensor | None] | None = None
    timers: Timers = field(default_factory=lambda: _NULL_TIMERS)
    # Graph mode times only around the captured call (events inside would be frozen at capture).
    time_inside_schedule: bool = True
    observer: Any = None  # StepObserver (stragglers, dumps) or None when both are off
    # Device-gated step (graph mode, fused AdamW): enqueued right after forward-backward, before
    # the rerun machine's host read, on a second stream; it skips itself on the device when the
    # pass's checks failed. ``join_gated_step`` orders later work after it (no host sync).
    gated_step: Callable[[], torch.Tensor | None] | None = None
    join_gated_step: Callable[[], None] | None = None
    # Graph mode: set per iteration by the trainer when the next iteration may be launched
    # ahead of this one's validation read (``stalwart.train.speculative``); called with this
    # iteration's forward-backward keyword arguments (without ``data_iterator``).
    speculate: Callable[[dict[str, Any]], None] | None = None


def _zero_grad(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def train_step(parts: StepParts, data_iterator: Any) -> StepResult:
    """One iteration: rerun-guarded forward/backward, exit decision, then clip and step.

    The rerun state machine may run forward/backward twice (replay with the same data and RNG);
    if it asks to exit, the optimizer is not stepped.
    """
    reported: list[dict[str, torch.Tensor]] = []
    timers = parts.timers
    inner: dict[str, Any] = {}
    if parts.time_inside_schedule:
        inner = {"timers": timers, "observer": parts.observer}
    gated = _GatedStep(parts)
    call_kwargs = {
        "forward_step_func": parts.forward_step_func,
        "model": parts.model,
        "num_microbatches": parts.num_microbatches,
        "loss_scaler": parts.loss_scaler,
        **inner,
    }
    num_passes = 0
    losses: dict[str, torch.Tensor] = {}
    while parts.rerun.should_run_forward_backward(data_iterator):
        gated.join()  # a rerun pass must not race the overlapped optimizer replay
        timers(FORWARD_BACKWARD).start()
        (parts.zero_grad or (lambda: _zero_grad(parts.model)))()
        reported = parts.forward_backward_func(data_iterator=data_iterator, **call_kwargs)
        if parts.after_backward is not None:
            parts.after_backward()  # records device-side gradient checks for this pass
        timers(FORWARD_BACKWARD).stop()
        gated.maybe_launch()  # before the loop condition's host read, which it overlaps
        num_passes += 1
        if num_passes == 1 and gated.stepped and parts.speculate is not None:
            # The next replay overwrites the graph's outputs and gradients: average first,
            # order it after the optimizer step, then launch it ahead of the host read.
            losses = average_reported(reported, parts.dp_group)
            gated.join()
            parts.speculate(call_kwargs)
    gated.join()
    should_checkpoint, should_exit, exit_code = parts.rerun.should_checkpoint_and_exit()
    if reported and (num_passes > 1 or not losses):
        losses = average_reported(reported, parts.dp_group)
    if should_exit:
        return StepResult(losses, None, None, True, should_checkpoint, True, exit_code)
    if gated.stepped:
        return StepResult(losses, gated.grad_norm, None, False)
    params = [p for p in parts.model.parameters() if p.requires_grad]
    timers(OPTIMIZER).start()
    try:
        if parts.clip_and_step is not None:
            return StepResult(losses, parts.clip_and_step(params, parts.clip_grad), None, False)
        return _clip_and_step(parts, params, losses)
    finally:
        timers(OPTIMIZER).stop()


class _GatedStep:
    """Tracks the device-gated optimizer step of one iteration (see ``StepParts.gated_step``).

    Launched only in an iteration's initial pass (``allows_step_before_validation``). The machine
    accepts that pass exactly when the gate let the step through (both reject non-finite checks;
    the gate is max-reduced across ranks), so after an accepted single pass the step is done. A
    rerun pass clears it: the final decision then goes through the normal, host-decided step.
    """

    def __init__(self, parts: StepParts) -> None:
        self._parts = parts
        self._pending_join = False
        self.stepped = False
        self.grad_norm: torch.Tensor | None = None

    def maybe_launch(self) -> None:
        """After each pass: launch the gated step if the machine allows it; ``stepped`` then
        says whether the final pass launched it."""
        parts = self._parts
        if parts.gated_step is None or not parts.rerun.allows_step_before_validation():
            self.stepped = False
            return
        parts.timers(OPTIMIZER).start()
        self.grad_norm = parts.gated_step()
        parts.timers(OPTIMIZER).stop()
        self._pending_join = self.stepped = True

    def join(self) -> None:
        if self._pending_join and self._parts.join_gated_step is not None:
            self._parts.join_gated_step()
        self._pending_join = False


def _clip_and_step(
    parts: StepParts, params: list[nn.Parameter], losses: dict[str, torch.Tensor]
) -> StepResult:
    timers = parts.timers
    found_inf = parts.loss_scaler.unscale_and_check(params)
    timers(OPTIMIZER_CLIP_MAIN_GRAD).start()
    grad_norm = grad_norm_and_clip(params, parts.clip_grad)
    timers(OPTIMIZER_CLIP_MAIN_GRAD).stop()
    num_zeros = None
    if parts.log_num_zeros:
        timers(OPTIMIZER_COUNT_ZEROS).start()
        num_zeros = count_zeros(params)
        timers(OPTIMIZER_COUNT_ZEROS).stop()
    skipped = False
    if found_inf is not None:
        # Deliberate sync (fp16 only): an overflow must skip the optimizer step.
        skipped = bool(found_inf.item() > 0)
        parts.loss_scaler.update(skipped)
    if not skipped:
        timers(OPTIMIZER_INNER_STEP).start()
        (parts.optimizer_step or parts.optimizer.step)()
        timers(OPTIMIZER_INNER_STEP).stop()
    return StepResult(losses, grad_norm, num_zeros, skipped)
