"""FLOPs of any model, counted once: forward + backward of one micro-batch under torch's
``FlopCounterMode``, for the training log's TFLOP/s (``--log-throughput``).

The bundled GPT keeps its analytic formula (``stalwart.models.num_floating_point_operations``,
Megatron's); any other model is counted: torch's counter knows the FLOPs of every matmul,
convolution and attention kernel it dispatches (``torch.utils.flop_counter``), which is the
library that does this job well, so nothing here estimates by hand. On the reference GPT the two
agree within 5% (``tests/observability/test_flop_count.py``).

Usage in your own loop (a Hugging Face model here; any ``nn.Module`` works)::

    >>> import torch
    >>> from torch import nn
    >>> from stalwart.observability.flop_count import count_training_flops
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    >>> batch = torch.randn(8, 16)
    >>> counted = count_training_flops(model, lambda b, m: m(b).square().mean(), batch)
    >>> counted.forward                         # 2*8*16*32 + 2*8*32*4
    10240
    >>> counted.per_microbatch                  # + backward: 2x forward, minus one matmul
    22528
    >>> counted.per_iteration(num_microbatches=4, data_parallel_size=2)  # the job's, for the log
    180224.0

(The backward is ``2 x 10240 - 8192``: the first layer needs no gradient of its input, so its
backward is one matmul, not two.) The count runs the model once on a real micro-batch and leaves no
trace: every random generator, the parameters' ``.grad`` and the module buffers (e.g. BatchNorm
statistics) are restored afterwards, so training is bitwise the same as without counting (tested).
It is a collective when the model is (FSDP2, DDP): call it on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stalwart.rng_state import capture_rng_state, restore_rng_state

__all__ = ["CountedFlops", "count_flops", "count_training_flops", "flop_counter"]


@dataclass(frozen=True)
class CountedFlops:
    """The FLOPs of one micro-batch's forward + backward on this rank (counted once; cached by
    holding this object)."""

    per_microbatch: int
    forward: int

    def per_iteration(self, num_microbatches: int = 1, data_parallel_size: int = 1) -> float:
        """The whole job's FLOPs of one iteration (what ``TrainingLog(flops_per_iteration=)``
        takes): micro-batches of equal shape on every data-parallel rank."""
        if num_microbatches < 1 or data_parallel_size < 1:
            raise ValueError(
                f"num_microbatches and data_parallel_size must be >= 1, got "
                f"{num_microbatches} and {data_parallel_size}"
            )
        return float(self.per_microbatch * num_microbatches * data_parallel_size)


def flop_counter() -> Any:
    """torch's ``FlopCounterMode``, also counting the CPU attention kernel and grouped-query
    attention.

    torch's registry knows the CUDA attention kernels (flash, memory-efficient, cuDNN) but not
    ``_scaled_dot_product_flash_attention_for_cpu`` (what ``scaled_dot_product_attention`` runs
    on the CPU), so a count on the CPU would miss attention entirely; it gets torch's own SDPA
    formulas here (the same ones the CUDA kernels use), so CPU and GPU counts agree."""
    from torch.utils import flop_counter as fc

    mapping: dict[Any, Any] = {}
    aten = torch.ops.aten
    # The CUDA kernels are mapped too: torch's formulas assert that key and value have the
    # query's heads, which grouped-query attention through the flash kernel does not have.
    for name in SDPA_KERNELS:
        forward = getattr(aten, name, None)
        backward = getattr(aten, name + "_backward", None)
        if forward is not None:
            mapping[forward] = _sdpa_forward
        if backward is not None:
            mapping[backward] = _sdpa_backward
    # A custom op that the counter cannot see into registers its formula with torch
    # (``torch.utils.flop_counter.register_flop_formula``), where its module defines the op:
    # the fused output layer + loss of ``stalwart.models.fused_cross_entropy`` does.
    return fc.FlopCounterMode(display=False, custom_mapping=mapping)


SDPA_KERNELS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def _query_heads(query: Any, kv: Any) -> Any:
    """``kv``'s shape ``[b, groups, s, d]`` counted with the query's heads: grouped-query
    attention reads each key/value head for several query heads; the work is per query head."""
    if len(kv) == 4 and len(query) == 4 and kv[1] != query[1]:
        return (kv[0], query[1], kv[2], kv[3])
    return kv


def _sdpa_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    # shapes: the counter passes shapes
    return int(sdpa_flop_count(query, _query_heads(query, key), _query_heads(query, value)))


def _sdpa_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    key, value = _query_heads(query, key), _query_heads(query, value)
    return int(sdpa_backward_flop_count(grad, query, key, value))


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of everything ``fn()`` dispatches (torch's counter; no side effect is undone)."""
    with flop_counter() as counter:
        fn()
    return int(counter.get_total_flops())


def count_training_flops(
    model: nn.Module,
    forward_step: Callable[[Any, nn.Module], Any],
    batch: Any,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> CountedFlops:
    """Count one micro-batch: ``forward_step(batch, model)`` (a loss, or a dict with ``"loss"``)
    and its backward, then restore RNGs, gradients and buffers (see the module docstring).

    Call it once at start-up, before the first iteration and after loading a checkpoint.
    """
    rng = capture_rng_state()
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with flop_counter() as counter:
            with autocast():
                output = forward_step(batch, model)
            loss = output["loss"] if isinstance(output, dict) else output
            forward = int(counter.get_total_flops())
            loss.backward()
        total = int(counter.get_total_flops())
    finally:
        restore_rng_state(rng)
        for param, grad in grads.items():
            param.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return CountedFlops(per_microbatch=total, forward=forward)
