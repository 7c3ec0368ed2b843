"""Per-iteration observation hooks of the step: straggler compute regions and tensor dumps.

The schedule calls ``on_microbatch(index, is_last)`` and wraps each forward/backward in
``compute()``; the trainer calls ``begin_iteration``/``end_iteration``. With both probes off the
trainer passes no observer at all, so the schedule pays nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from stalwart.config.run import RunConfig
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT
from stalwart.models.memory_model import CUDA_WORKSPACE_BYTES, theoretical_memory
from stalwart.observability.dumps import (
    DumpConfig,
    NullTensorDumper,
    TensorDumper,
    make_tensor_dumper,
)
from stalwart.observability.energy import make_energy_meter
from stalwart.observability.memory import MemoryMonitor
from stalwart.observability.memory_release import NullMemoryRelease
from stalwart.observability.profiler import NullProfilerWindow, ProfilerWindow, make_profiler_window
from stalwart.observability.save_timing import SaveTiming
from stalwart.observability.sinks import MetricSink, build_sinks
from stalwart.observability.straggler import (
    NullStragglerDetector,
    StragglerDetector,
    StragglerIdle,
    make_straggler_detector,
)
from stalwart.observability.throughput import compute_dtype, device_peak_tflops
from stalwart.observability.timers import Timers
from stalwart.observability.train_log import TrainingLog

logger = logging.getLogger("stalwart.train")


class StepObserver:
    """Straggler detector + tensor dumper behind the schedule's two hook points."""

    def __init__(
        self,
        straggler: StragglerDetector | NullStragglerDetector,
        dumper: TensorDumper | NullTensorDumper,
    ) -> None:
        self.straggler = straggler
        self.dumper = dumper
        self.memory_release: Any = None
        self.faults: Any = None  # an injector firing after the backward (grad_corruption)
        self._rank = 0
        self._iteration = 0

    def with_memory_release(
        self, release: Any, faults: Any = None, rank: int = 0
    ) -> StepObserver | None:
        """The observer the step calls (None when nothing observes): these probes,
        ``--empty-unused-memory-level``'s release after each forward-backward, and a fault
        injector of the ``backward`` phase (``--inject-fault grad_corruption``)."""
        after_backward = getattr(faults, "phase", None) == "backward"
        if isinstance(release, NullMemoryRelease) and not self.enabled and not after_backward:
            return None
        self.memory_release = release
        self.faults, self._rank = (faults if after_backward else None), rank
        return self

    def after_forward_backward(self) -> None:
        if self.faults is not None:  # the gradients are all-reduced, the step not taken yet
            self.faults.maybe_inject(self._iteration, self._rank, "backward")
        if self.memory_release is not None:
            self.memory_release.after_forward_backward()

    @property
    def allows_lookahead(self) -> bool:
        """Dumps attribute a forward to the iteration that runs it: no launch ahead then."""
        return isinstance(self.dumper, NullTensorDumper)

    @property
    def enabled(self) -> bool:
        return not (
            isinstance(self.straggler, NullStragglerDetector)
            and isinstance(self.dumper, NullTensorDumper)
        )

    def begin_iteration(self, iteration: int) -> None:
        self._iteration = iteration
        self.dumper.begin_iteration(iteration)

    def on_microbatch(self, index: int, is_last: bool) -> None:
        self.dumper.begin_microbatch(index, is_last)

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """Region counted as this rank's compute (excludes collectives and the optimizer); a
        micro-batch's forward and backward. On exit the dumper records the micro-batch (tokens per
        expert; after the last one, the gradients before clipping)."""
        if isinstance(self.dumper, NullTensorDumper):
            return self.straggler.compute()
        return self._compute_and_record()

    @contextlib.contextmanager
    def _compute_and_record(self) -> Iterator[None]:
        with self.straggler.compute():
            yield
        self.dumper.end_microbatch()

    def iteration_region(self) -> contextlib.AbstractContextManager[Any]:
        """A whole forward-backward call (compute + its collectives): the straggler's comm."""
        return self.straggler.iteration_region()

    def graph_safe(self) -> StragglerDetector | None:
        """What may run inside a captured graph: the straggler's compute regions (external
        CUDA events, re-recorded by every replay); dumps may not (they read tensors)."""
        return self.straggler.graph_safe()

    def end_iteration(self) -> None:
        self.straggler.step()
        self.dumper.end_iteration()

    def close(self) -> None:
        self.dumper.close()
        self.straggler.close()


def run_dir_of(config: RunConfig) -> str | None:
    """Where run artefacts go: ``--run-dir``, else the checkpoint directory, else nowhere."""
    return config.obs.run_dir or config.checkpoint.save


def metrics_file_of(config: RunConfig) -> str | None:
    """``--metrics-file``, else ``<run dir>/metrics.jsonl`` (what ``stalwart report`` reads)."""
    run_dir = run_dir_of(config)
    if config.obs.metrics_file:
        return config.obs.metrics_file
    return os.path.join(run_dir, "metrics.jsonl") if run_dir else None


def build_probes(
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
        on_at_start=not obs.disable_straggler_on_startup,
    )
    estimate = theoretical_memory(
        config.model,
        config.training.micro_batch_size,
        ctx.world_size,
        bf16=config.training.bf16,
        workspace_bytes=0 if ctx.device.type == "cpu" else CUDA_WORKSPACE_BYTES,
        fused_rms_norm=ctx.device.type == "cuda",  # torch's fused RMSNorm kernel is CUDA-only
        compute_weights=config.training.bf16_compute_weights,
        grad_accumulation_fusion=config.training.gradient_accumulation_fusion,
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


def build_profiler(config: RunConfig, ctx: DistributedContext) -> ProfilerWindow:
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


def build_observability(
    config: RunConfig, ctx: DistributedContext, flops: float, model: GPT, ledger: Any
) -> tuple[Timers, MetricSink, TrainingLog, StepObserver, Any, SaveTiming]:
    """Timers, sinks, the training log with its providers (probes, save timing, goodput),
    the step observer, the energy meter and the save timing."""
    obs, run_dir = config.obs, run_dir_of(config)
    timers = Timers(
        obs.timing_log_level,
        obs.timing_log_option,
        mode=obs.timing_mode,
        device=ctx.device,
    )
    sink = build_sinks(
        rank=ctx.rank,
        tensorboard_dir=obs.tensorboard_dir,
        tensorboard_queue_size=obs.tensorboard_queue_size,
        wandb_project=obs.wandb_project,
        wandb_exp_name=obs.wandb_exp_name,
        wandb_save_dir=obs.wandb_save_dir,
        wandb_mode=obs.wandb_mode,
        # Restarts and relaunches continue the same W&B run (the id lives with the run).
        wandb_resume_file=os.path.join(run_dir, "wandb_run_id.txt") if run_dir else None,
        config=config.to_dict(),
        grouped=obs.group_metric_tags,
    )
    providers, observer = build_probes(config, ctx, model, sink)
    saves = SaveTiming(timers, ledger=ledger)
    goodput = [StragglerIdle(observer.straggler, ledger), saves, ledger]
    log = TrainingLog(
        config.log,
        train_iters=config.training.train_iters,
        sink=sink,
        timers=timers,
        rank=ctx.rank,
        world_size=ctx.world_size,
        flops_per_iteration=flops,
        metrics_file=metrics_file_of(config) if ctx.rank == 0 else None,
        extra_providers=[*providers, *goodput],
        seq_length=config.model.seq_length,  # tokens/s
        peak_tflops_per_gpu=device_peak_tflops(
            ctx.device, compute_dtype(config.training.bf16, config.training.fp16)
        ),
    )
    return timers, sink, log, observer, providers[2], saves
