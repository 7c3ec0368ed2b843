"""Build every collaborator of a training run from a :class:`RunConfig`.

Nothing here is global: :func:`build_components` returns one :class:`Components` value that the
trainer owns and that in-process restart can throw away and build again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import random
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stalwart.checkpoint import CheckpointManager
from stalwart.config.run import RunConfig
from stalwart.data import (
    MicroBatchIterator,
    SampleSource,
    WorkerMicroBatchIterator,
    build_datasets,
    calculate_num_microbatches,
)
from stalwart.data.batch_schedule import BatchSchedule
from stalwart.distributed.process_group import DistributedContext
from stalwart.graphs import make_capturable_adamw
from stalwart.models import GPT, num_floating_point_operations
from stalwart.observability.dumps import DumpConfig, make_tensor_dumper
from stalwart.observability.energy import make_energy_meter
from stalwart.observability.memory import CUDA_WORKSPACE_BYTES, MemoryMonitor, theoretical_memory
from stalwart.observability.memory_release import (
    NullMemoryRelease,
    UnusedMemoryRelease,
    make_memory_release,
)
from stalwart.observability.profiler import NullProfilerWindow, ProfilerWindow, make_profiler_window
from stalwart.observability.sinks import MetricSink, build_sinks
from stalwart.observability.straggler import make_straggler_detector
from stalwart.observability.timers import BATCH_GENERATOR, Timers, TimingMode
from stalwart.observability.train_log import TrainingLog
from stalwart.reliability.faults import FaultInjector, NullFaultInjector, build_fault_injector
from stalwart.reliability.replica_check import ReplicaConsistencyChecker, flip_parameter_bit
from stalwart.reliability.rerun import (
    RerunDataIterator,
    RerunStateMachine,
    check_grads,
    check_loss,
    make_state_machine,
    register_grad_check_hook,
    resolve_iterations_to_skip,
)
from stalwart.reliability.sections import NullSectionMonitor, SectionMonitor, build_section_monitor
from stalwart.reliability.signals import DataLoaderWorkerSignalGuard, DistributedSignalHandler
from stalwart.train.forward_step import GPTForwardStep
from stalwart.train.graphed import check_graph_flags, use_graphs
from stalwart.train.manual_gc import ManualGC, NullManualGC, make_manual_gc
from stalwart.train.observe import StepObserver
from stalwart.train.precision import NullLossScaler, autocast_context, build_loss_scaler
from stalwart.train.schedule import LRScheduler
from stalwart.train.speculative import SpeculativeForwardBackward
from stalwart.train.step import StepParts, forward_backward

logger = logging.getLogger("stalwart.train")


@dataclass
class Components:
    """Everything a run owns. Built by :func:`build_components`, released by ``close()``."""

    config: RunConfig
    ctx: DistributedContext
    model: nn.Module  # wrapped (DDP/FSDP2) module used for training
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    loss_scaler: NullLossScaler
    sampler: MicroBatchIterator | WorkerMicroBatchIterator
    train_iterator: RerunDataIterator[Any]
    valid_dataset: SampleSource
    num_microbatches: int  # at the final global batch size (evaluation uses it)
    global_batch_size: int  # the final one; batch_schedule gives each iteration's
    batch_schedule: BatchSchedule
    checkpoint: CheckpointManager
    rerun: RerunStateMachine
    timers: Timers
    sink: MetricSink
    log: TrainingLog
    sections: SectionMonitor | NullSectionMonitor
    faults: FaultInjector | NullFaultInjector
    replica_checker: ReplicaConsistencyChecker
    signal_handler: DistributedSignalHandler | None
    step_parts: StepParts
    observer: StepObserver
    energy: Any
    profiler: ProfilerWindow
    manual_gc: ManualGC | NullManualGC
    forward_step: GPTForwardStep
    eval_forward_step: GPTForwardStep
    # Graph mode: the full-iteration graph's evaluation stage, losses checked on the host.
    eval_forward_backward_func: Callable[..., Any] = forward_backward
    eval_checks_losses_on_host: bool = False
    # Graph mode: drop the CUDA graphs (idempotent); an NCCL abort waits for captured work.
    release_graphs: Callable[[], None] | None = None
    # Graph mode: launches the next forward-backward ahead of the validation read, or None.
    speculation: SpeculativeForwardBackward | None = None
    iterations_to_skip: frozenset[int] = frozenset()  # numbered from 1, as logged
    flops_per_iteration: float = 0.0  # at the final global batch size
    # --empty-unused-memory-level (after forward-backward: chained into step_parts.after_backward).
    memory_release: UnusedMemoryRelease | NullMemoryRelease = field(
        default_factory=NullMemoryRelease
    )
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Release processes, files and handlers (safe to call twice)."""
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                closer()
        self.closers.clear()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases/LayerNorm/position vectors do not (GPT-2 convention)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = config.optim
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.graphs.optimizer_cuda_graph:
        device = next(model.parameters()).device
        # Capturable AdamW with the LR as a device tensor, so a schedule works under replay;
        # fused, so in-graph validation can skip the step on the device (found_inf).
        return make_capturable_adamw(
            groups,
            lr=o.lr,
            device=device,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            fused=device.type == "cuda",
        )
    return torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True
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
    if ctx.device.type == "cuda" and config.graphs.cuda_graph_impl == "full_iteration":
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


def run_dir_of(config: RunConfig) -> str | None:
    """Where run artefacts go: ``--run-dir``, else the checkpoint directory, else nowhere."""
    return config.obs.run_dir or config.checkpoint.save


def metrics_file_of(config: RunConfig) -> str | None:
    """``--metrics-file``, else ``<run dir>/metrics.jsonl`` (what ``stalwart report`` reads)."""
    run_dir = run_dir_of(config)
    if config.obs.metrics_file:
        return config.obs.metrics_file
    return os.path.join(run_dir, "metrics.jsonl") if run_dir else None


def _build_probes(
    config: RunConfig, ctx: DistributedContext, model: GPT, sink: MetricSink
) -> tuple[list[Any], StepObserver]:
    """Straggler detector, memory monitor and energy meter (log providers) + tensor dumper."""
    obs, run_dir = config.obs, run_dir_of(config)
    straggler = make_straggler_detector(
        obs.log_straggler,
        ctx.device,
        ctx.rank,
        ctx.world_size,
        threshold=obs.straggler_threshold,
        minmax_count=obs.straggler_minmax_count,
        run_dir=run_dir,
    )
    estimate = theoretical_memory(
        config.model,
        config.training.micro_batch_size,
        ctx.world_size,
        bf16=config.training.bf16,
        workspace_bytes=0 if ctx.device.type == "cpu" else CUDA_WORKSPACE_BYTES,
        fused_rms_norm=ctx.device.type == "cuda",  # torch's fused RMSNorm kernel is CUDA-only
    )
    memory = MemoryMonitor(
        ctx.device,
        estimate,
        run_dir=run_dir,
        rank=ctx.rank,
        log_interval=config.log.log_interval,
        log_memory_interval=obs.log_memory_interval or None,
        to_tensorboard=obs.log_memory_to_tensorboard,
        sink=sink,
        log=logger.info,
    )
    energy = make_energy_meter(obs.log_energy, ctx.device, log=logger.info)
    dump_config = DumpConfig.from_flags(
        save_activations_interval=obs.save_activations_interval,
        log_dgrads=obs.log_dgrads,
        log_tokens_per_expert=obs.log_tokens_per_expert,
        dump_stats_only=obs.dump_stats_only,
        log_interval=config.log.log_interval,
        save_wgrads_interval=obs.save_wgrads_interval,
        save_params_interval=obs.save_params_interval,
        save_dgrads_interval=obs.save_dgrads_interval,
        save_tokens_per_expert_interval=obs.save_tokens_per_expert_interval,
    )
    dump_dir = obs.dump_dir or run_dir or "."
    dumper = make_tensor_dumper(model, dump_dir, dump_config, ctx.rank, ctx.rank)
    return [straggler, memory, energy], StepObserver(straggler, dumper)


def _build_profiler(config: RunConfig, ctx: DistributedContext) -> ProfilerWindow:
    obs = config.obs
    if not obs.profile:
        return NullProfilerWindow()
    if not any(r < ctx.world_size for r in obs.profile_ranks):
        raise ValueError(
            f"--profile-ranks {obs.profile_ranks}: no such rank in a job of {ctx.world_size}"
        )
    run_dir = run_dir_of(config)
    out_dir = obs.profile_dir or os.path.join(run_dir or ".", "profile")
    return make_profiler_window(
        True,
        obs.profile_step_start,
        obs.profile_step_end,
        out_dir=out_dir,
        rank=ctx.rank,
        device=ctx.device,
        use_pytorch_profiler=obs.use_pytorch_profiler,
        ranks=obs.profile_ranks,
    )


def _build_observability(
    config: RunConfig, ctx: DistributedContext, flops: float, model: GPT
) -> tuple[Timers, MetricSink, TrainingLog, StepObserver, Any]:
    obs, run_dir = config.obs, run_dir_of(config)
    timers = Timers(
        obs.timing_log_level,
        obs.timing_log_option,
        mode=TimingMode.EVENTS if obs.timing_mode == "events" else TimingMode.SYNC,
        device=ctx.device,
    )
    sink = build_sinks(
        rank=ctx.rank,
        tensorboard_dir=obs.tensorboard_dir,
        wandb_project=obs.wandb_project,
        wandb_exp_name=obs.wandb_exp_name,
        wandb_save_dir=obs.wandb_save_dir,
        wandb_mode=obs.wandb_mode,
        # Restarts and relaunches continue the same W&B run (the id lives with the run).
        wandb_resume_file=os.path.join(run_dir, "wandb_run_id.txt") if run_dir else None,
        config=config.to_dict(),
    )
    providers, observer = _build_probes(config, ctx, model, sink)
    log = TrainingLog(
        config.log,
        train_iters=config.training.train_iters,
        sink=sink,
        timers=timers,
        rank=ctx.rank,
        world_size=ctx.world_size,
        flops_per_iteration=flops,
        metrics_file=metrics_file_of(config) if ctx.rank == 0 else None,
        extra_providers=providers,
        seq_length=config.model.seq_length,  # tokens/s on the progress bar
    )
    return timers, sink, log, observer, providers[2]


def _build_sampler(
    config: RunConfig, ctx: DistributedContext, train_ds: SampleSource
) -> MicroBatchIterator | WorkerMicroBatchIterator:
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
    )
    if workers == 0:
        return source
    # Workers ignore the exit signal: a job-wide SIGTERM (scancel) must not end them while this
    # process finishes the step and saves; they stop with close() or with this process.
    worker_signals = [config.exit.signal_enum]
    if config.exit.exit_on_interrupt:  # Ctrl-C reaches the workers too (one process group)
        worker_signals.append(signal.SIGINT)
    guard = DataLoaderWorkerSignalGuard(dict.fromkeys(worker_signals))
    return WorkerMicroBatchIterator(source, workers, pin_memory=pin, worker_init_fn=guard)


def build_components(config: RunConfig, ctx: DistributedContext) -> Components:
    """Construct the model, optimizer, data, checkpointing and reliability/observability shell."""
    closers: list[Any] = []
    ckpt_cfg = config.checkpoint
    faults = build_fault_injector(config.faults, ckpt_cfg.save, ctx.world_size)
    checkpoint = CheckpointManager(
        ckpt_cfg.save,
        ckpt_cfg.load_dir,
        keep_last=ckpt_cfg.ckpt_keep_last,
        async_save=ckpt_cfg.async_save,
        fallback=ckpt_cfg.ckpt_fallback,
        non_persistent_dir=ckpt_cfg.non_persistent_ckpt_dir,
        before_commit=lambda iteration: faults.maybe_inject(iteration, ctx.rank, "commit"),
    )
    closers.append(checkpoint.close)  # releases the --save lock (atexit does if building fails)
    if ckpt_cfg.save:
        checkpoint.check_writable()  # fail before any training work; takes the --save lock
    sections = build_section_monitor(config.ft, ctx.rank, ckpt_cfg.save)
    closers.append(sections.close)

    graphed = config.graphs.cuda_graph_impl == "full_iteration"
    if graphed:
        check_graph_flags(config, ctx.device, ctx.world_size)  # before any expensive set-up
    train_ds, valid_ds, num_microbatches, gbs = _build_data(config, ctx)
    batch_schedule = BatchSchedule.from_flags(
        gbs, config.training.micro_batch_size, ctx.world_size, config.training.rampup_batch_size
    )
    if config.training.train_samples is not None:  # resolve --train-samples to iterations
        iters = batch_schedule.iterations_for_samples(config.training.train_samples)
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, train_iters=iters)
        )
    seed_everything(config.training.seed)  # identical initial weights on every rank
    raw_model = GPT(config.model).to(ctx.device)
    if isinstance(faults, FaultInjector):  # --inject-fault bitflip corrupts this rank's weights
        faults.corrupt_weights = functools.partial(flip_parameter_bit, raw_model)
    if config.training.compile:
        # In place (nn.Module.compile): parameter names and checkpoints stay unchanged. Under a
        # full-iteration graph Inductor's own CUDA graphs are off (they cannot nest).
        options = {"triton.cudagraphs": False} if graphed else None
        raw_model.compile(dynamic=False, options=options)
    model = wrap_model(raw_model, config, ctx)
    seed_everything(config.training.seed + 100 * ctx.rank)  # distinct dropout streams per rank
    optimizer = build_optimizer(model, config)
    scheduler = LRScheduler(
        optimizer, config.optim, config.training.train_iters, config.training.train_samples
    )
    loss_scaler = build_loss_scaler(config.training)

    rerun = make_state_machine(
        config.rerun,
        state_save_func=loss_scaler.state_dict,
        state_restore_func=loss_scaler.load_state_dict,
    )
    sampler = _build_sampler(config, ctx, train_ds)
    if isinstance(sampler, WorkerMicroBatchIterator):
        closers.append(sampler.close)
    train_iterator: RerunDataIterator[Any] = RerunDataIterator(sampler)
    forward_step = GPTForwardStep(
        ctx.device,
        autocast=lambda: autocast_context(config.training, ctx.device),
        loss_check=lambda loss: check_loss(rerun, loss, config.rerun),
    )
    memory_release = make_memory_release(config.obs.empty_unused_memory_level, ctx.device)
    after_backward = _grad_checks(model, rerun, config, ctx)
    if not isinstance(memory_release, NullMemoryRelease):
        after_backward = _then(after_backward, memory_release.after_forward_backward)
    step_parts = StepParts(
        model=model,
        optimizer=optimizer,
        forward_step_func=forward_step,
        num_microbatches=num_microbatches,
        clip_grad=config.optim.clip_grad,
        loss_scaler=loss_scaler,
        rerun=rerun,
        log_num_zeros=config.log.log_num_zeros_in_grad,
        after_backward=after_backward,
    )
    release_graphs, speculation = None, None
    if graphed:
        release_graphs, speculation = use_graphs(
            config, ctx, model, optimizer, rerun, forward_step, step_parts, train_iterator
        )
        closers.append(release_graphs)
    flops = num_floating_point_operations(config.model, gbs)
    timers, sink, log, observer, energy = _build_observability(config, ctx, flops, raw_model)
    step_parts.timers = timers
    if not graphed:  # inside a captured graph host timers would be frozen at capture
        forward_step.batch_timer = timers(BATCH_GENERATOR)
    step_parts.observer = observer if observer.enabled else None
    profiler = _build_profiler(config, ctx)
    t = config.training
    manual_gc = make_manual_gc(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)
    closers.append(manual_gc.close)
    closers.extend([sink.close, log.close, observer.close, energy.close, profiler.close])
    handler = None
    if config.exit.handles_signals:  # the exit signal and/or Ctrl-C (exit_on_interrupt)
        handler = config.exit.make_signal_handler()
        handler.__enter__()
        closers.append(handler.release)
    return Components(
        config=config,
        ctx=ctx,
        model=model,
        raw_model=raw_model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_scaler=loss_scaler,
        sampler=sampler,
        train_iterator=train_iterator,
        valid_dataset=valid_ds,
        num_microbatches=num_microbatches,
        global_batch_size=gbs,
        batch_schedule=batch_schedule,
        checkpoint=checkpoint,
        rerun=rerun,
        timers=timers,
        sink=sink,
        log=log,
        sections=sections,
        faults=faults,
        replica_checker=ReplicaConsistencyChecker(
            config.rerun.check_weight_hash_across_dp_replicas_interval
        ),
        signal_handler=handler,
        memory_release=memory_release,
        step_parts=step_parts,
        observer=observer,
        energy=energy,
        profiler=profiler,
        manual_gc=manual_gc,
        forward_step=forward_step,
        # Eval losses are still checked (the machine is disabled then: a NaN raises, a spike warns).
        eval_forward_step=GPTForwardStep(
            ctx.device,
            forward_step.autocast,
            loss_check=None if graphed else lambda loss: check_loss(rerun, loss, config.rerun),
        ),
        eval_forward_backward_func=step_parts.forward_backward_func,
        eval_checks_losses_on_host=graphed,
        release_graphs=release_graphs,
        speculation=speculation,
        iterations_to_skip=frozenset(resolve_iterations_to_skip(config.rerun)),
        flops_per_iteration=flops,
        closers=closers,
    )


def _then(first: Callable[[], None] | None, second: Callable[[], None]) -> Any:
    """``first`` (if any), then ``second``."""
    if first is None:
        return second

    def both() -> None:
        first()
        second()

    return both


def _grad_checks(
    model: nn.Module, rerun: RerunStateMachine, config: RunConfig, ctx: DistributedContext
) -> Any:
    """Gradient NaN/Inf/large checks: a DDP comm hook (before the all-reduce) or a post-backward
    check of the local gradients (single rank, FSDP2)."""
    wants = config.rerun.check_for_nan_in_loss_and_grad or config.rerun.check_for_large_grads
    if not wants:
        return None
    if isinstance(model, DistributedDataParallel):
        register_grad_check_hook(model, rerun, config.rerun)
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: check_grads(rerun, params, config.rerun)
