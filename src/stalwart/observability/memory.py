"""Theoretical vs measured memory for the reference GPT.

Usage in a hand-written loop::

    est = theoretical_memory(cfg, micro_batch_size=8, dp_size=world, num_parameters=n_params)
    monitor = MemoryMonitor(device, est, run_dir=run_dir, log_memory_interval=100)
    ...
    if it % log_interval == 0:
        monitor.on_log_step(it)        # first call after optimizer.step(): writes memory.json
        sink.add_scalars(monitor.scalars(), it)

As a `TrainingLog` provider, ``monitor.log_fields(info)`` calls ``on_log_step(info.iteration)``;
pass ``to_tensorboard=True, sink=sink`` for ``--log-memory-to-tensorboard``.

Weights + optimizer, in bytes per parameter (stalwart's reference trainer keeps fp32 master
weights in place and runs bf16 autocast, so there is no separate bf16 parameter copy):

    bf16=True : fp32 param 4 + fp32 grad 4 + Adam m 4 + Adam v 4 + autocast bf16 weight copy 2 = 18
    bf16=False: fp32 param 4 + fp32 grad 4 + Adam m 4 + Adam v 4                                = 16
    sharded optimizer (Adam m, v sharded over DP): 10 + 8/DP (bf16) or 8 + 8/DP (fp32)

Megatron's layout (bf16 param 2 + fp32 grad 4 + fp32 main param 4 + m 4 + v 4) gives the same 18
unsharded and ``6 + 12/DP`` with its distributed optimizer; `megatron_bytes_per_parameter` returns
it for comparison. The autocast copy is counted because ``F.linear`` saves the bf16 weight for
backward, so the copies live from forward until backward of each micro-batch.

Activations (bytes) of one micro-batch in flight: gradient accumulation frees each micro-batch's
activations in its own backward. Notation: t = b*s tokens, e = 2 (bf16 autocast) or 4 (fp32),
f = ffn size, n_h = heads, V = vocab, E = experts, k = top-k, p = dropout. What
``stalwart.models.GPT`` saves for backward in eager PyTorch with flash/cuDNN SDPA (the residual
stream and LayerNorm outputs are fp32 because autocast runs layer_norm in fp32):

    attention part of a layer = t*(4h + 8 [LN1 input fp32, mean/rstd] + e*h [QKV input, autocast
        copy] + 3e*h [QKV output = SDPA q, k, v views] + e*h [SDPA output = proj input, a view]
        + 4h + 8 [LN2 input, mean/rstd] + h*[p>0] [residual-dropout mask]) + 4*b*n_h*s [logsumexp]
    dense MLP                 = t*(e*h [fc1 input] + 2e*f [fc1 output = GELU input, GELU output]
        + h*[p>0])
    MoE MLP                   = t*(4h [router input, fp32] + 4E [softmax] + 24k [top-k, gates])
        + N*(e*h + 2e*f) [expert input, fc1 out, GELU out] + e*k*t*h [gathered outputs]
        + t*h*[p>0], N = E * capacity (capacity = min(t, ceil(cf*k*t/E)), or t when cf is None)
    embedding                 = 16t [input ids, labels] + t*h*[p>0]
    head                      = t*(4h + 8) [final LN input] + e*t*h [lm-head input] + 4t*V [saved
                                log-softmax output, fp32]
    loss backward transient   = 8t*V [grad of the log-probs + grad of the fp32 logits, alive
                                together with the saved log-softmax output: the peak]

    activation_bytes = L*(attention + MLP) + embedding + head + transient
    total_bytes      = weights_optimizer_bytes + max(activation_bytes, optimizer transient)
                       + workspace_bytes
        optimizer transient = 4 bytes/param (foreach AdamW's sqrt(v) temporary; activations are
        freed by then)
        workspace_bytes = 64 MiB by default: the cuBLAS and cuBLASLt workspaces (32 MiB each on
        Hopper) that the caching allocator holds after the first matmul; pass 0 for CPU

Checked on an H200 (torch 2.11, cuDNN SDPA, AdamW foreach, 4 micro-batches of 8): theoretical /
``max_memory_allocated`` = 0.99-1.0 for the tiny, small and gpt2-124m presets, bf16 and fp32,
with dropout 0.1 and with 4 experts top-2 (tests/observability/test_memory_gpu.py).

Not counted: the CUDA context, cuBLAS/cuDNN workspaces, allocator fragmentation (compare with
``mem-max-allocated-bytes``, not reserved), and the math SDPA backend used on CPU (it saves the
[b, n_h, s, s] attention probabilities).

Measured: ``measured_memory(device)`` reads the CUDA caching allocator statistics; on CPU it reports
the process resident set size (RSS), which includes the Python heap and libraries and is only a
coarse upper bound.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from stalwart.observability.sinks import MetricSink
from stalwart.observability.train_log import IntervalInfo, LogField

MEMORY_FILE = "memory.json"
MIB = 1 << 20
CUDA_WORKSPACE_BYTES = 64 * MIB


class GPTShape(Protocol):
    """The fields of ``stalwart.models.GPTConfig`` the estimator reads (read-only)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def seq_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def ffn_hidden_size(self) -> int | None: ...

    @property
    def dropout(self) -> float: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def moe_router_topk(self) -> int: ...

    @property
    def moe_capacity_factor(self) -> float | None: ...


@dataclass(frozen=True)
class MemoryEstimate:
    """Theoretical peak memory of one rank, in bytes.

    Attributes:
        weights_optimizer_bytes: parameters, gradients, Adam states, autocast weight copies.
        activation_bytes: saved activations of one micro-batch plus the backward transient.
        total_bytes: weights_optimizer + max(activation, optimizer-step transient) + workspaces.
        num_parameters: parameters counted (experts included).
        bytes_per_parameter: effective bytes per parameter used above.
        breakdown: named terms (bytes) of both parts, for the report.
    """

    weights_optimizer_bytes: float
    activation_bytes: float
    total_bytes: float
    num_parameters: int = 0
    bytes_per_parameter: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def bytes_per_parameter(dp_size: int, sharded_optimizer: bool, bf16: bool) -> float:
    """Weights+optimizer bytes per parameter for stalwart's layout (see the module docstring)."""
    replicated = 4.0 + 4.0 + (2.0 if bf16 else 0.0)
    adam = 8.0
    return replicated + (adam / dp_size if sharded_optimizer else adam)


def megatron_bytes_per_parameter(dp_size: int, distributed_optimizer: bool) -> float:
    """Megatron's formula: 18 without the distributed optimizer, else 6 + 12/DP."""
    return 6.0 + 12.0 / dp_size if distributed_optimizer else 18.0


def count_parameters(cfg: GPTShape) -> int:
    """Parameters of the reference GPT (tied embeddings, learned positions, biases, LayerNorm).

    Pass the exact ``sum(p.numel() ...)`` to `theoretical_memory` when the model exists; this count
    is for planning before building it.
    """
    h, v, s = cfg.hidden_size, cfg.vocab_size, cfg.seq_length
    f = cfg.ffn_hidden_size or 4 * h
    attn = h * 3 * h + 3 * h + h * h + h
    mlp = h * f + f + f * h + h
    if cfg.num_experts > 0:
        mlp = cfg.num_experts * mlp + h * cfg.num_experts
    layer = attn + mlp + 2 * 2 * h
    return v * h + s * h + cfg.num_layers * layer + 2 * h


def _expert_slots(cfg: GPTShape, tokens: int) -> int:
    """Rows the experts compute: num_experts * capacity, as ``stalwart.models.moe`` dispatches."""
    cf = cfg.moe_capacity_factor
    if cf is None:
        capacity = tokens
    else:
        capacity = max(
            1, min(tokens, math.ceil(cf * cfg.moe_router_topk * tokens / cfg.num_experts))
        )
    return cfg.num_experts * capacity


def activation_breakdown(cfg: GPTShape, micro_batch_size: int, bf16: bool) -> dict[str, float]:
    """Named activation terms in bytes for one micro-batch (formula in the module docstring)."""
    h, s, b = cfg.hidden_size, cfg.seq_length, micro_batch_size
    f = cfg.ffn_hidden_size or 4 * h
    e = 2.0 if bf16 else 4.0
    t = float(b * s)
    mask = t * h if cfg.dropout > 0 else 0.0
    attn = t * (8 * h + 16 + 5 * e * h) + mask + 4.0 * b * cfg.num_attention_heads * s
    if cfg.num_experts > 0:
        k = cfg.moe_router_topk
        mlp = t * (4 * h + 4 * cfg.num_experts + 24 * k) + e * k * t * h
        mlp += _expert_slots(cfg, b * s) * (e * h + 2 * e * f)
    else:
        mlp = t * (e * h + 2 * e * f)
    v = cfg.vocab_size
    return {
        "layers.attention": cfg.num_layers * attn,
        "layers.mlp": cfg.num_layers * (mlp + mask),
        "embedding": 16 * t + mask,
        "head": t * (4 * h + 8) + e * t * h + 4 * t * v,
        "loss_backward_transient": 8 * t * v,
    }


def theoretical_memory(
    config: GPTShape,
    micro_batch_size: int,
    dp_size: int,
    sharded_optimizer: bool = False,
    bf16: bool = True,
    num_parameters: int | None = None,
    workspace_bytes: float = CUDA_WORKSPACE_BYTES,
) -> MemoryEstimate:
    """Estimate one rank's peak memory for the reference GPT trained with AdamW.

    Args:
        config: a ``GPTConfig`` (or anything with its fields).
        micro_batch_size: sequences per micro-batch.
        dp_size: data-parallel size (only matters with ``sharded_optimizer``).
        sharded_optimizer: Adam states sharded over data-parallel ranks.
        bf16: bf16 autocast over fp32 weights (else pure fp32).
        num_parameters: exact parameter count; `count_parameters(config)` when ``None``.
        workspace_bytes: fixed library workspaces (cuBLAS/cuBLASLt on CUDA; 0 on CPU).
    """
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    n = num_parameters if num_parameters is not None else count_parameters(config)
    bpp = bytes_per_parameter(dp_size, sharded_optimizer, bf16)
    acts = activation_breakdown(config, micro_batch_size, bf16)
    adam = 8.0 / dp_size if sharded_optimizer else 8.0
    breakdown = {
        "params_fp32": 4.0 * n,
        "grads_fp32": 4.0 * n,
        "adam_states": adam * n,
        "autocast_weight_copies": (2.0 if bf16 else 0.0) * n,
        **{f"activation.{k}": val for k, val in acts.items()},
    }
    weights = bpp * n
    activation = sum(acts.values())
    optimizer_transient = 4.0 * n / (dp_size if sharded_optimizer else 1)
    breakdown["optimizer_step_transient"] = optimizer_transient
    breakdown["library_workspaces"] = workspace_bytes
    return MemoryEstimate(
        weights_optimizer_bytes=weights,
        activation_bytes=activation,
        total_bytes=weights + max(activation, optimizer_transient) + workspace_bytes,
        num_parameters=n,
        bytes_per_parameter=bpp,
        breakdown=breakdown,
    )


def measured_memory(device: torch.device) -> dict[str, float]:
    """Memory now and at peak, Megatron key names where they exist.

    CUDA: ``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ``mem-reserved-bytes``,
    ``mem-max-reserved-bytes``, ``mem-allocated-count``, ``mem-alloc-retries``, ``mem-ooms``.
    CPU: ``mem-rss-bytes`` and ``mem-max-rss-bytes`` (process resident set size: Python, libraries
    and tensors together).
    """
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-allocated-bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "mem-max-allocated-bytes": float(stats.get("allocated_bytes.all.peak", 0)),
            "mem-reserved-bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "mem-max-reserved-bytes": float(stats.get("reserved_bytes.all.peak", 0)),
            "mem-allocated-count": float(stats.get("allocation.all.current", 0)),
            "mem-alloc-retries": float(stats.get("num_alloc_retries", 0)),
            "mem-ooms": float(stats.get("num_ooms", 0)),
        }
    # ru_maxrss is KiB on Linux, bytes on macOS.
    max_rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    max_rss *= 1.0 if sys.platform == "darwin" else 1024.0
    return {"mem-rss-bytes": _current_rss(), "mem-max-rss-bytes": max_rss}


def _current_rss() -> float:
    try:
        import psutil  # optional: more exact than /proc parsing on every platform
    except ImportError:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0.0
    return float(psutil.Process().memory_info().rss)


def compare(estimate: MemoryEstimate, measured: dict[str, float]) -> dict[str, object]:
    """Pure: the theoretical-vs-measured record written to ``memory.json``."""
    peak = measured.get("mem-max-allocated-bytes", measured.get("mem-max-rss-bytes", 0.0))
    source = "cuda-allocator" if "mem-max-allocated-bytes" in measured else "cpu-rss"
    ratio = estimate.total_bytes / peak if peak > 0 else None
    return {
        "theoretical": estimate.to_dict(),
        "measured": measured,
        "measured_source": source,
        "measured_peak_bytes": peak,
        "theoretical_over_measured": ratio,
    }


def validate_memory_args(log_interval: int, log_memory_interval: int | None) -> None:
    """``--log-memory-interval`` is off when None or 0, else a positive multiple of the log interval."""
    if not log_memory_interval:
        return
    if log_memory_interval < 1 or log_memory_interval % log_interval != 0:
        raise ValueError(
            "--log-memory-interval must be a positive multiple of --log-interval "
            f"({log_interval}), got {log_memory_interval}"
        )


class MemoryMonitor:
    """Theoretical-vs-measured report once, then periodic measured memory.

    ``on_log_step(iteration)`` runs at log steps *after* the optimizer step (so Adam states exist).
    The first call writes ``<run_dir>/memory.json`` (rank 0 only) and logs Megatron's two lines
    ("Theoretical memory footprints: ..." and "[Rank r] (after N iterations) memory (MB) | ...");
    later calls read memory every ``log_memory_interval`` iterations (``--log-memory-interval``).
    With ``to_tensorboard`` (``--log-memory-to-tensorboard``) the ``mem-*`` byte values go to
    ``sink.add_scalars`` (TensorBoard/W&B only, as Megatron). Each read is one allocator-statistics
    call: host only, no device sync.
    """

    def __init__(
        self,
        device: torch.device,
        estimate: MemoryEstimate | None,
        run_dir: str | os.PathLike[str] | None = None,
        rank: int = 0,
        log_interval: int = 1,
        log_memory_interval: int | None = None,
        to_tensorboard: bool = False,
        sink: MetricSink | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        validate_memory_args(log_interval, log_memory_interval)
        self.device = device
        self.estimate = estimate
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self.log_memory_interval = log_memory_interval
        self.to_tensorboard = to_tensorboard
        self.sink = sink
        self._log = log
        self._reported = False
        self._last: dict[str, float] = {}

    def on_log_step(self, iteration: int) -> dict[str, float] | None:
        """Read memory if due (first call or interval); returns the measured dict when read."""
        first = not self._reported
        due = bool(self.log_memory_interval) and iteration % (self.log_memory_interval or 1) == 0
        if not (first or due):
            self._last = {}
            return None
        measured = measured_memory(self.device)
        self._last = measured
        if self.to_tensorboard and self.sink is not None:
            self.sink.add_scalars(measured, iteration)
        if first:
            self._reported = True
            self._first_report(iteration, measured)
        return measured

    def _first_report(self, iteration: int, measured: dict[str, float]) -> None:
        if self.rank == 0 and self.estimate is not None:
            est = self.estimate
            self._log(
                f"Theoretical memory footprints: weight and optimizer="
                f"{est.weights_optimizer_bytes / MIB:.2f} MB, activation="
                f"{est.activation_bytes / MIB:.2f} MB, total={est.total_bytes / MIB:.2f} MB"
            )
        self._log(f"[Rank {self.rank}] (after {iteration} iterations) {format_measured(measured)}")
        if self.rank != 0 or self.estimate is None or self.run_dir is None:
            return
        record = compare(self.estimate, measured)
        record.update(iteration=iteration, time=time.time(), device=str(self.device))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / (MEMORY_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(tmp, self.run_dir / MEMORY_FILE)

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        """`LogFieldProvider`: the peak-memory field at the steps that read memory."""
        measured = self.on_log_step(info.iteration)
        if not measured:
            return []
        if "mem-max-allocated-bytes" in measured:
            peak = measured["mem-max-allocated-bytes"]
            return [LogField("mem max allocated (MB)", peak / MIB, "{:.1f}")]
        return [LogField("mem max RSS (MB)", measured["mem-max-rss-bytes"] / MIB, "{:.1f}")]

    def scalars(self) -> dict[str, float]:
        """The latest ``mem-*`` values (empty at steps that did not read memory)."""
        return dict(self._last)


def format_measured(measured: dict[str, float]) -> str:
    """Megatron-style "memory (MB) | allocated: ... |" text (RSS on CPU)."""
    names = (
        ("mem-allocated-bytes", "allocated"),
        ("mem-max-allocated-bytes", "max allocated"),
        ("mem-reserved-bytes", "reserved"),
        ("mem-max-reserved-bytes", "max reserved"),
        ("mem-rss-bytes", "process RSS"),
        ("mem-max-rss-bytes", "max process RSS"),
    )
    parts = [f"{label}: {measured[k] / MIB:.1f}" for k, label in names if k in measured]
    return "memory (MB) | " + " | ".join(parts)


class NullMemoryMonitor:
    """Memory reporting off: no allocator reads, no file."""

    def on_log_step(self, iteration: int) -> None:
        return None

    def log_fields(self, info: IntervalInfo) -> list[LogField]:
        return []

    def scalars(self) -> dict[str, float]:
        return {}
