"""One pass over an iteration's micro-batches: forward, checks, scaled backward (accumulation).

:class:`MicroBatches` is the function a plan runs eagerly or captures whole into a
full-iteration CUDA graph. It may run a prefix of the micro-batches (the look-ahead launches the
next iteration's first micro-batch before this one is read) and the rest later. Host syncs: none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from stalwart.loop.compute_weights import NO_COMPUTE_WEIGHTS
from stalwart.loop.observer import NULL_OBSERVER, PassHooks
from stalwart.loop.precision import NullLossScaler
from stalwart.observability.timer_names import BACKWARD_COMPUTE, BATCH_GENERATOR, FORWARD_COMPUTE
from stalwart.observability.timers import NullTimer, Timer
from stalwart.reliability.rerun import GradCheckState, RerunStateMachine

ForwardStep = Callable[[Any, nn.Module], "torch.Tensor | dict[str, torch.Tensor]"]
"""``forward_step(batch, model)``: the loss (a tensor), or a dict whose ``"loss"`` is
backpropagated and whose other entries are reported (averaged over micro-batches and ranks)."""

Reported = list[dict[str, torch.Tensor]]


GradientSync = Callable[[bool], contextlib.AbstractContextManager[Any]]


def no_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Reduce gradients only when ``sync``: DDP's ``no_sync`` or FSDP2's
    ``set_requires_gradient_sync`` (which keeps unsharded gradients until the last backward)."""
    return gradient_sync(model)(sync)


def gradient_sync(model: nn.Module) -> GradientSync:
    """:func:`no_sync` for ``model``, its kind (DDP, FSDP2, neither) looked up once: each
    lookup that misses goes through ``nn.Module.__getattr__``, which raises and catches."""
    if hasattr(model, "no_sync"):
        # DDP's no_sync() is a context manager; mypy sees a module attribute (Tensor | Module).
        ddp_no_sync = cast(Callable[[], contextlib.AbstractContextManager[Any]], model.no_sync)
        return lambda sync: contextlib.nullcontext() if sync else ddp_no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(set_sync):
        return lambda sync: _fsdp2_sync(set_sync, sync)
    return _always_synced


def _always_synced(sync: bool) -> contextlib.AbstractContextManager[Any]:
    del sync
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_sync(set_sync: Callable[[bool], None], sync: bool) -> Iterator[None]:
    set_sync(sync)
    try:
        yield
    finally:
        set_sync(True)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (non-blocking), in dicts/lists/tuples.
    A tensor already there is returned as it is (what ``.to`` returns, without its dispatch)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def as_output(output: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A forward step's return value as a dict with a ``"loss"`` entry."""
    if isinstance(output, torch.Tensor):
        return {"loss": output}
    if "loss" not in output:
        raise ValueError(
            f"forward_step returned a dict without a 'loss' entry (keys: {sorted(output)})"
        )
    return output


class StepTimers(Protocol):
    """The run's timers as the step reads them (:class:`stalwart.observability.timers.Timers`;
    :data:`NO_TIMERS` when nothing is timed)."""

    def __call__(self, name: str, log_level: int | None = None) -> Timer | NullTimer: ...


class _NoTimers:
    _timer = NullTimer()

    def __call__(self, name: str, log_level: int | None = None) -> NullTimer:
        del name, log_level
        return self._timer


NO_TIMERS: StepTimers = _NoTimers()


@dataclass
class MicroBatches:
    """Runs micro-batches ``[first, stop)`` of a pass of ``num_microbatches``.

    Gradients are zeroed at ``first == 0`` (unless ``zero_grad`` is ``"none"``: a graph zeroes
    them in place), each loss is checked by the machine, divided by ``num_microbatches`` and
    scaled; after the last micro-batch the gradient checks run (without DDP: DDP's comm hook
    runs them) and the machine's skip gate is written (max-reduced over ``gate_group``).
    ``compute_weights`` (:class:`stalwart.loop.ComputeWeights`): its copies are refreshed at
    ``first == 0``, swapped in for each micro-batch, and their gradients added into the fp32
    ``.grad`` after each backward.
    """

    model: nn.Module
    forward_step: ForwardStep
    machine: RerunStateMachine
    device: torch.device
    loss_scaler: NullLossScaler
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    grad_checks: GradCheckState | None = None  # post-backward checks (no DDP)
    gate_group: dist.ProcessGroup | None = None
    zero_grad: str = "none_grads"  # "none_grads" (set to None) | "in_place" | "none"
    timers: StepTimers = NO_TIMERS
    observer: PassHooks = NULL_OBSERVER
    # Evaluation under a graph: a per-micro-batch host check would run at capture only, so the
    # step checks the evaluation means on the host instead.
    check_eval_losses: bool = True
    compute_weights: Any = NO_COMPUTE_WEIGHTS
    # A framework's backward (Lightning's ``manual_backward``: it prepares DDP's reducer first).
    backward: Callable[[torch.Tensor], None] | None = None
    # model.parameters() walks every submodule (a Hugging Face model: hundreds of Python
    # calls per pass); the parameters do not change under a step, so they are listed once.
    _params: list[nn.Parameter] | None = field(default=None, repr=False)
    _sync: GradientSync | None = field(default=None, repr=False)  # gradient_sync(model), once

    def __call__(
        self,
        *,
        data_iterator: Iterator[Any],
        num_microbatches: int,
        forward_only: bool = False,
        first: int = 0,
        stop: int | None = None,
        **_: Any,
    ) -> Reported:
        stop = num_microbatches if stop is None else stop
        if first == 0 and not forward_only:
            self._zero_grad()
        if first == 0:
            self.compute_weights.refresh()  # the weights changed since the last pass
        losses: list[torch.Tensor] = []
        reported = [
            self._one(data_iterator, index, num_microbatches, forward_only, losses, stop)
            for index in range(first, stop)
        ]
        if stop == num_microbatches and not forward_only:
            if self.grad_checks is not None:
                self.grad_checks.check_after_backward()
            self._update_gate()
        return reported

    def _one(
        self,
        data: Iterator[Any],
        index: int,
        num_microbatches: int,
        forward_only: bool,
        losses: list[torch.Tensor],
        stop: int,
    ) -> dict[str, torch.Tensor]:
        is_last = index == num_microbatches - 1
        # Evaluation is not training compute (and must not replace a training graph's regions).
        observer = NULL_OBSERVER if forward_only else self.observer
        observer.on_microbatch(index, is_last)
        compute = observer.compute()
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        forward_timer, backward_timer = self.timers(FORWARD_COMPUTE), self.timers(BACKWARD_COMPUTE)
        weights = self.compute_weights.using()  # forward and backward: recompute needs them
        if self._sync is None:
            self._sync = gradient_sync(self.model)
        with grad_mode, self._sync(is_last or forward_only), compute, weights:
            forward_timer.start()
            batch_timer = self.timers(BATCH_GENERATOR)
            batch_timer.start()
            batch = to_device(next(data), self.device)
            batch_timer.stop()
            with self.autocast():
                output = as_output(self.forward_step(batch, self.model))
            reported = _detached(output)
            self._check_losses(
                losses, reported["loss"], flush=index == stop - 1, forward_only=forward_only
            )
            forward_timer.stop()
            if not forward_only:
                backward_timer.start()
                scaled = self.loss_scaler.scale_loss(output["loss"] / num_microbatches)
                if self.backward is None:
                    scaled.backward()
                else:
                    self.backward(scaled)
                # The first micro-batch's fp32 gradients were zeroed above (or by the graph).
                self.compute_weights.accumulate(overwrite=index == 0)
                backward_timer.stop()
        return reported

    def _check_losses(
        self, losses: list[torch.Tensor], loss: torch.Tensor, flush: bool, forward_only: bool
    ) -> None:
        """Megatron checks each loss in its loss function; the span's losses are recorded in
        one call after the last forward instead (the same slots, verdicts and order: still
        before the last backward, where DDP's hook records the gradient checks), a few device
        ops per pass instead of a write per micro-batch. ``loss`` is detached."""
        if forward_only and not self.check_eval_losses:
            return
        losses.append(loss)
        if flush:
            self.machine.recorder.check_losses(losses)

    def _zero_grad(self) -> None:
        if self.zero_grad == "none":
            return
        if self._params is None:
            self._params = list(self.model.parameters())
        if self.zero_grad == "none_grads":
            for p in self._params:
                p.grad = None
        elif self.zero_grad == "in_place":
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def _update_gate(self) -> None:
        buffer = self.machine.recorder.buffer
        if buffer is not None:
            buffer.update_gate(self.gate_group)


def _detached(output: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``output`` without autograd history: a value that has none (a reported value the
    forward step detached already, every value under ``no_grad``) is kept as it is, and a
    tensor reported under two keys (the loss as ``"lm loss"``) is detached once."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for k, v in output.items():
        if not v.requires_grad:
            out[k] = v
            continue
        d = done.get(id(v))
        if d is None:
            d = done[id(v)] = v.detach()
        out[k] = d
    return out


class PassValues(list[dict[str, torch.Tensor]]):
    """A whole pass's reported values with their means over the micro-batches already computed
    on the device (``means[i]`` is key ``keys[i]``'s), by :func:`with_means` inside the captured
    function: replaying the graph computes them, so no host op averages them per iteration."""

    def __init__(self, reported: Reported, keys: tuple[str, ...], means: torch.Tensor) -> None:
        super().__init__(reported)
        self.keys, self.means = keys, means


def _reported_keys(reported: Reported) -> list[str]:
    return [k for k in reported[0] if k != "loss"] or ["loss"]


def _means(reported: Reported, keys: list[str]) -> torch.Tensor:
    """The mean over the micro-batches of every key's values, one entry per key (1-d)."""
    if len(keys) == 1:  # a view of the one mean, not a copy
        return _mean_of(reported, keys[0]).unsqueeze(0)
    return torch.stack([_mean_of(reported, k) for k in keys])


def _mean_of(reported: Reported, key: str) -> torch.Tensor:
    values = [_float(r[key]) for r in reported]
    # One micro-batch: the mean of a view of its value, the same reduction over the same
    # elements as of a stacked copy, one copy fewer.
    return (values[0].unsqueeze(0) if len(values) == 1 else torch.stack(values)).mean()


def _float(value: torch.Tensor) -> torch.Tensor:
    """``value.float()``: the value itself when it is float32 already (without the dispatch)."""
    return value if value.dtype is torch.float32 else value.float()


def with_means(forward_backward: Callable[..., Reported]) -> Callable[..., Reported]:
    """``forward_backward`` returning :class:`PassValues` (the means computed in the same call:
    inside a graph's capture, so every replay computes them on the device)."""

    def body(**kwargs: Any) -> Reported:
        reported = forward_backward(**kwargs)
        if not reported:
            return reported
        keys = _reported_keys(reported)
        return PassValues(reported, tuple(keys), _means(reported, keys))

    return body


def average_reported(
    reported: Reported, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Mean over micro-batches and data-parallel ranks of every reported value except ``loss``
    (``loss`` itself when nothing else is reported).

    One all-reduce of a stacked device tensor (asynchronous on NCCL: no host sync). A
    :class:`PassValues` brings its means: they are copied (a graph's outputs are overwritten by
    its next replay), not computed again; the values are the same.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if isinstance(reported, PassValues):
        keys, stacked = list(reported.keys), reported.means.clone()
    else:
        keys = _reported_keys(reported)
        if len(keys) == 1 and not distributed:  # the one mean itself, no 1-d view of it
            return {keys[0]: _mean_of(reported, keys[0])}
        stacked = _means(reported, keys)
    if distributed:
        dist.all_reduce(stacked, group=group)
        stacked = stacked / dist.get_world_size(group)
    if len(keys) == 1:  # the one value as a view, without unbind's dispatch
        return {keys[0]: stacked.reshape(())}
    return dict(zip(keys, stacked.unbind(0), strict=True))
