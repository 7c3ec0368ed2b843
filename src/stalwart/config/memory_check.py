"""Refuse a run that cannot fit in memory before anything is allocated or written.

`check_run_fits` adds up what one rank needs at least (`theoretical_memory`: weights, gradients,
Adam states and one micro-batch's activations; plus the token batches of an iteration kept for
the rerun machine and the next one read ahead) and compares it with what the device can give
(`stalwart.observability.memory_budget.available_memory`). ``--micro-batch-size 1000000000``
or ``--ffn-hidden-size 1000000000000`` then end in one line naming the flags, not in a hang while
memory grows or an allocation traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stalwart.models.memory_model import CUDA_WORKSPACE_BYTES, theoretical_memory
from stalwart.observability.memory_budget import GIB, available_memory, check_fits

if TYPE_CHECKING:
    from stalwart.config.run import RunConfig


def estimate_run_bytes(
    config: RunConfig, device: torch.device, world_size: int
) -> dict[str, float]:
    """Lower bound of one rank's peak memory, in bytes: ``weights``, ``activations``, ``data``."""
    training, model = config.training, config.model
    mbs = training.micro_batch_size
    est = theoretical_memory(
        model,
        mbs,
        max(world_size, 1),
        bf16=training.bf16 or training.fp16,
        workspace_bytes=0 if device.type == "cpu" else CUDA_WORKSPACE_BYTES,
    )
    weights = est.weights_optimizer_bytes
    if training.use_torch_fsdp2:
        weights /= max(world_size, 1)  # parameters, gradients and Adam states are sharded
    global_batch = training.global_batch_size or mbs * max(world_size, 1)
    micro_batches = max(1, global_batch // (mbs * max(world_size, 1)))
    # int64 inputs and labels of every micro-batch of the iteration, and of the next one read
    # ahead (the rerun machine replays the recorded ones).
    data = 2.0 * micro_batches * 2 * 8 * mbs * model.seq_length
    transient = est.total_bytes - est.weights_optimizer_bytes
    return {"weights": weights, "activations": transient, "data": data}


def check_run_fits(
    config: RunConfig, device: torch.device, *, world_size: int = 1, local_world_size: int = 1
) -> None:
    """``ValueError`` naming the flags when the run certainly cannot fit on ``device``."""
    parts = estimate_run_bytes(config, device, world_size)
    needed = sum(parts.values())
    available, where = available_memory(
        device, ranks_sharing=local_world_size if device.type == "cpu" else 1
    )
    if available is None or needed <= available:
        return
    m = config.model
    model_flags = (
        f"--num-layers {m.num_layers}, --hidden-size {m.hidden_size}, "
        f"--ffn-hidden-size {m.ffn_size}, --vocab-size {m.vocab_size}"
        + (f", --num-experts {m.num_experts}" if m.num_experts else "")
    )
    model = f"weights and optimizer {parts['weights'] / GIB:.3g} GiB ({model_flags})"
    batch = (
        f"activations and batches {(parts['activations'] + parts['data']) / GIB:.3g} GiB "
        f"(--micro-batch-size {config.training.micro_batch_size}, --seq-length {m.seq_length})"
    )
    first, second = (model, batch) if parts["weights"] >= parts["activations"] else (batch, model)
    check_fits(needed, available, where=where, cause=f"{first}, {second}; lower them")
