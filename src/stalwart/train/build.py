"""Small builders of the reference trainer's parts, one per part, each from its config.

Nothing here is global and nothing is changed after it is built: the trainer calls these once
per run (an in-process restart throws everything away and calls them again).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stalwart.compile import CompileCache, NullCompileCache
from stalwart.config.inductor import parse_inductor_options
from stalwart.config.run import RunConfig
from stalwart.data import (
    MicroBatchIterator,
    SampleSource,
    WorkerMicroBatchIterator,
    build_datasets,
    calculate_num_microbatches,
)
from stalwart.data.batch_schedule import BatchSchedule
from stalwart.distributed.ddp_layout import needs_settled_layout, settle_bucket_layout
from stalwart.distributed.process_group import DistributedContext
from stalwart.graphs import (
    CudaGraphImpl,
    GraphSettings,
    check_graph_config,
    clip_in_optimizer_step,
    make_capturable_adamw,
)
from stalwart.loop import ComputeWeights, DynamicLossScaler, NullLossScaler, autocast_context
from stalwart.loop.compute_weights import FSDP2_COMPUTE_WEIGHTS_MESSAGE
from stalwart.models import GPT, RecomputeGranularity
from stalwart.models.memory_model import CUDA_WORKSPACE_BYTES, MemoryEstimate, theoretical_memory
from stalwart.models.recompute import SELECTIVE_RECOMPUTE_MODULES
from stalwart.reliability.faults import FaultInjector, NullFaultInjector
from stalwart.reliability.rerun.attribution.fingerprints import (
    flip_gradient_bit,
    flip_parameter_bit,
)
from stalwart.reliability.signals import DataLoaderWorkerSignalGuard

logger = logging.getLogger("stalwart.train")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases/LayerNorm/position vectors do not (GPT-2 convention).
    With ``--clip-grad-in-optimizer`` the clip factor is the fused step's ``grad_scale``."""
    optimizer = _adamw(model, config)
    if config.optim.clip_grad_in_optimizer:
        clip_in_optimizer_step(optimizer)
    return optimizer


def _adamw(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = config.optim
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    device = next(model.parameters()).device
    if config.graphs.optimizer_captured:
        # Capturable AdamW with the LR as a device tensor, so a schedule works under replay;
        # fused, so the step can skip itself on the device (found_inf).
        return make_capturable_adamw(
            groups,
            lr=o.lr,
            device=device,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            fused=True,
        )
    # Fused: one kernel, and it reads the rerun machine's skip gate as found_inf, so the step is
    # enqueued before the validation read (stalwart.loop.optimizer).
    return torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, fused=True
    )


def wrap_model(model: GPT, config: RunConfig, ctx: DistributedContext) -> nn.Module:
    """DDP (or FSDP2 with ``--use-torch-fsdp2``) across ranks; the bare model on one rank."""
    if not ctx.is_distributed:
        return model
    if config.training.use_torch_fsdp2:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    stream: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if ctx.device.type == "cuda" and config.graphs.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION:
        # DDP keeps the AccumulateGrad nodes it creates here; created on the legacy default
        # stream, capturing a backward through them is an illegal implicit sync (torch docs,
        # "CUDA graphs: usage with DistributedDataParallel"): construct on a side stream.
        stream = torch.cuda.stream(torch.cuda.Stream(ctx.device))
    with warnings.catch_warnings(), stream:
        # Router counters are rank-local buffers: they must not be broadcast (newer torch
        # deprecates the flag in favour of one that still syncs at init).
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def _build_data(
    config: RunConfig, ctx: DistributedContext
) -> tuple[SampleSource, SampleSource, int, int]:
    train, valid = build_datasets(
        config.data.data_path,
        config.model.seq_length,
        config.model.vocab_size,
        data_dtype=config.data.data_dtype,
        valid_fraction=config.data.valid_fraction,
    )
    mbs = config.training.micro_batch_size
    gbs = config.training.global_batch_size or mbs * ctx.world_size
    num_microbatches = calculate_num_microbatches(gbs, mbs, ctx.world_size)
    return train, valid, num_microbatches, gbs


def build_sampler(
    config: RunConfig, ctx: DistributedContext, train_ds: SampleSource, num_microbatches: int = 1
) -> MicroBatchIterator | WorkerMicroBatchIterator:
    """The training micro-batches; without workers an iteration's ``num_microbatches`` are built
    at once into one pinned buffer (one host-to-device copy into a graph's static inputs)."""
    pin = ctx.device.type == "cuda"
    workers = config.data.num_workers
    source = MicroBatchIterator(
        train_ds,
        config.training.micro_batch_size,
        ctx.rank,
        ctx.world_size,
        seed=config.training.seed,
        shuffle=config.data.shuffle,
        pin_memory=pin and workers == 0,  # with workers, the DataLoader pins in this process
        chunk_microbatches=num_microbatches if workers == 0 else 1,
    )
    if workers == 0:
        return source
    # Workers ignore the exit signal: a job-wide SIGTERM (scancel) must not end them while this
    # process finishes the step and saves; they stop with close() or with this process.
    worker_signals = [config.shell.exit.signal_enum]
    if config.shell.exit.exit_on_interrupt:  # Ctrl-C reaches the workers too (one process group)
        worker_signals.append(signal.SIGINT)
    guard = DataLoaderWorkerSignalGuard(dict.fromkeys(worker_signals))
    return WorkerMicroBatchIterator(source, workers, pin_memory=pin, worker_init_fn=guard)


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
        and config.graphs.full_iteration
        and device_type == "cuda"
        and world_size > 1
    ):
        raise ValueError(INPROCESS_NCCL_GRAPHS_MESSAGE.format(world_size=world_size))


def check_graph_flags(config: RunConfig, device: torch.device, world_size: int = 1) -> None:
    """Reject invalid graph/recompute/validation combinations before any set-up (ValueError).

    Runs whenever a graph flag is on (``--optimizer-cuda-graph`` alone included)."""
    check_inprocess_with_graphs(config, device.type, world_size)
    if not config.graphs.any:
        return
    g = config.graphs
    check_graph_config(
        GraphSettings(
            device=device,
            cuda_graph_impl=g.cuda_graph_impl,
            cuda_graph_warmup_steps=g.cuda_graph_warmup_steps,
            optimizer_cuda_graph=g.optimizer_captured,
            recompute_granularity=config.model.recompute_granularity,
            recompute_modules=(
                SELECTIVE_RECOMPUTE_MODULES
                if config.model.recompute_granularity is RecomputeGranularity.SELECTIVE
                else ()
            ),
            hidden_dropout=config.model.dropout,
            attention_dropout=config.model.dropout,
            # One dropout, set by --hidden-dropout (--attention-dropout must equal it).
            attention_dropout_flag="--hidden-dropout",
            has_moe=config.model.is_moe,
            check_for_nan_in_loss_and_grad=config.shell.rerun.check_for_nan_in_loss_and_grad,
            check_for_spiky_loss=config.shell.rerun.check_for_spiky_loss,
            check_for_large_grads=config.shell.rerun.check_for_large_grads,
            log_num_zeros_in_grad=config.shell.log.log_num_zeros_in_grad,
            fp16=config.training.fp16,
            compile=config.training.compile,
        )
    )


def build_loss_scaler(config: RunConfig) -> NullLossScaler:
    """``--fp16``: dynamic loss scaling with Megatron's hysteresis; otherwise none."""
    t = config.training
    if t.fp16:
        return DynamicLossScaler(
            t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis
        )
    return NullLossScaler()


def autocast_dtype(config: RunConfig) -> torch.dtype | None:
    if config.training.bf16:
        return torch.bfloat16
    return torch.float16 if config.training.fp16 else None


def resolve_config(config: RunConfig, ctx: DistributedContext) -> tuple[RunConfig, TrainData]:
    """The datasets and batch schedule, and the config with ``--train-samples`` resolved to
    iterations (a new value: the given config is not changed)."""
    data = build_data(config, ctx)
    if config.training.train_samples is not None:
        iters = data.schedule.iterations_for_samples(config.training.train_samples)
        config = config.replace_shared(train_iters=iters)
    return config, data


@dataclass(frozen=True)
class TrainData:
    """The datasets and the batch-size schedule of a run."""

    train: SampleSource
    valid: SampleSource
    num_microbatches: int  # at the final global batch size (evaluation uses it)
    global_batch_size: int  # the final one; schedule gives each iteration's
    schedule: BatchSchedule


def build_data(config: RunConfig, ctx: DistributedContext) -> TrainData:
    train, valid, num_microbatches, gbs = _build_data(config, ctx)
    schedule = BatchSchedule.from_flags(
        gbs, config.training.micro_batch_size, ctx.world_size, config.training.rampup_batch_size
    )
    return TrainData(train, valid, num_microbatches, gbs, schedule)


def build_model(
    config: RunConfig,
    ctx: DistributedContext,
    faults: FaultInjector | NullFaultInjector,
    for_loading: bool = False,
) -> tuple[GPT, nn.Module]:
    """The GPT (same initial weights on every rank) and its DDP/FSDP2 wrapper; ``for_loading``
    (a checkpoint will overwrite every weight): zero weights built on the device instead."""
    seed_everything(config.training.seed)  # identical initial weights on every rank
    if for_loading:
        raw_model = GPT.for_loading(config.model, ctx.device)
    else:
        raw_model = GPT(config.model).to(ctx.device)
    if isinstance(faults, FaultInjector):  # bitflip / grad_corruption: this rank's copy only
        faults.corrupt_weights = functools.partial(flip_parameter_bit, raw_model)
        faults.corrupt_grads = functools.partial(flip_gradient_bit, raw_model)
    model = wrap_model(raw_model, config, ctx)
    if needs_settled_layout(model):  # 3+ DDP ranks: a resume must reduce as an unbroken run
        tokens = torch.zeros(1, config.model.seq_length, dtype=torch.long, device=ctx.device)
        dtype = autocast_dtype(config)  # the step's autocast: the same ops as a training pass
        settle_bucket_layout(model, lambda m: _loss(m, tokens, autocast_context(ctx.device, dtype)))
    if config.training.compile:
        # In place (nn.Module.compile): parameter names and checkpoints stay unchanged. Under a
        # full-iteration graph Inductor's own CUDA graphs are off (they cannot nest).
        # --inductor-config: the user's per-compile Inductor options (checked by the config).
        options = parse_inductor_options(config.training.inductor_config)
        if config.graphs.full_iteration:
            options["triton.cudagraphs"] = False
        raw_model.compile(dynamic=False, options=options or None)
    seed_everything(config.training.seed + 100 * ctx.rank)  # distinct dropout streams per rank
    return raw_model, model


def _loss(
    model: nn.Module, tokens: torch.Tensor, precision: contextlib.AbstractContextManager[Any]
) -> torch.Tensor:
    """The GPT's training loss on ``tokens`` (eager: before ``torch.compile`` wraps it)."""
    with precision:
        return model(tokens, tokens)["loss"]


def build_compile_cache(config: RunConfig, rank: int) -> CompileCache | NullCompileCache:
    """``--compile``'s persistent cache (``--compile-cache-dir``, else ``<run dir>/compile_cache``;
    rank 0 writes its artifacts file), not yet open; the null cache without one."""
    location = config.compile_cache_location()
    if location is None:
        return NullCompileCache()
    flag, directory = location
    return CompileCache(directory, writer=rank == 0, flag=flag)


def open_compile_cache(
    config: RunConfig,
    rank: int,
    given: CompileCache | NullCompileCache | None,
    on_close: Callable[[Callable[[], None]], object],
) -> CompileCache | NullCompileCache:
    """The persistent compile cache the shell writes after an iteration that compiled:
    ``given`` (an open cache its owner keeps: the in-process restart wrapper's), or this run's
    own, opened now and closed through ``on_close``."""
    if given is not None:
        return given
    cache = build_compile_cache(config, rank).open()
    on_close(cache.close)
    return cache


def build_compute_weights(
    config: RunConfig, raw_model: GPT, ctx: DistributedContext
) -> ComputeWeights | None:
    """``--bf16-compute-weights``: bf16 copies of the GPT's matmul weights (one rank, or DDP:
    the guarded step then reduces the fp32 gradients itself; not with FSDP2)."""
    if not config.training.bf16_compute_weights:
        return None
    if ctx.is_distributed and config.training.use_torch_fsdp2:
        raise ValueError(FSDP2_COMPUTE_WEIGHTS_MESSAGE)
    return ComputeWeights(
        raw_model,
        dtype=torch.bfloat16,
        fuse_grad_accumulation=config.training.gradient_accumulation_fusion,
    )


def memory_estimate(config: RunConfig, ctx: DistributedContext) -> MemoryEstimate:
    """The GPT's theoretical memory per rank (the memory report's estimate)."""
    return theoretical_memory(
        config.model,
        config.training.micro_batch_size,
        ctx.world_size,
        bf16=config.training.bf16,
        workspace_bytes=0 if ctx.device.type == "cpu" else CUDA_WORKSPACE_BYTES,
        fused_rms_norm=ctx.device.type == "cuda",  # torch's fused RMSNorm kernel is CUDA-only
        compute_weights=config.training.bf16_compute_weights,
        grad_accumulation_fusion=config.training.gradient_accumulation_fusion,
    )
