"""The shell's training log (:class:`ShellLog`): built at its first use, after the model's FLOPs
are known, and fed each completed iteration's and evaluation's record (the log line, the sinks,
the metrics file). :class:`~stalwart.loop.Shell`'s ``set_flops``, ``log``, ``record`` and
``record_eval`` are this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stalwart.loop.checkpointing import LoopState
from stalwart.loop.naming import Names
from stalwart.loop.shell_settings import ShellSettings
from stalwart.loop.step import StepResult
from stalwart.observability.train_log import TensorOrScalar, TrainingLog


class ShellLog:
    """The training log of one shell: its settings (``config.log``, ``config.sinks``), the
    sink, the timers and the probes' fields; closed on ``stack``."""

    def __init__(
        self,
        config: ShellSettings,
        names: Names,
        *,
        rank: int,
        world_size: int,
        sink: Any,
        timers: Any,
        providers: list[Any],
        print_fn: Callable[..., None],
        stack: contextlib.ExitStack,
    ) -> None:
        self.config, self.names, self.rank, self.world_size = config, names, rank, world_size
        self._sink, self._timers, self._providers = sink, timers, providers
        self._print, self._stack = print_fn, stack
        self.built: TrainingLog | None = None  # the training log once built (first use)
        self.flops: float | None = None  # the whole job's FLOPs of one iteration
        self._peak_tflops: float | None = None

    def set_flops(self, flops_per_iteration: float, peak_tflops_per_gpu: float | None) -> None:
        """See :meth:`Shell.set_flops`."""
        if self.built is not None:
            raise RuntimeError("Shell.set_flops: the training log is already built")
        self.flops, self._peak_tflops = float(flops_per_iteration), peak_tflops_per_gpu

    @property
    def log(self) -> TrainingLog:
        """The training log, built at its first use (``ValueError`` when
        ``log.log_throughput`` is asked for and the FLOPs are not known yet)."""
        if self.built is None:
            cfg = self.config
            if cfg.log.log_throughput and self.flops is None:
                raise ValueError(
                    f"{self.names.spell('log.log_throughput')}: the model's FLOPs are not "
                    "known yet; call Shell.set_flops first (stalwart.observability.flop_count)"
                )
            metrics = cfg.sinks.metrics_path(cfg.artefact_dir) if self.rank == 0 else None
            self.built = TrainingLog(
                cfg.log,
                train_iters=cfg.train_iters,
                sink=self._sink,
                timers=self._timers,
                rank=self.rank,
                world_size=self.world_size,
                flops_per_iteration=self.flops,
                metrics_file=metrics,
                extra_providers=self._providers,
                print_fn=self._print,
                seq_length=cfg.seq_length,
                peak_tflops_per_gpu=self._peak_tflops,
            )
            self._stack.callback(self.built.close)
        return self.built

    def record(
        self,
        iteration: int,
        state: LoopState,
        model: nn.Module | None,
        result: StepResult | None,
        *,
        batch_size: int,
        losses: Mapping[str, TensorOrScalar] | None,
        consumed_samples: int | None,
        values: dict[str, Any],
    ) -> Mapping[str, Any] | None:
        """See :meth:`Shell.record`: ``iteration`` just completed, ``state`` the loop's count
        (its consumed samples advance here), ``model`` the watched one (parameter norms)."""
        if result is not None and result.verdict.rejected:
            return None
        state.consumed_samples = (
            state.consumed_samples + batch_size if consumed_samples is None else consumed_samples
        )
        if result is not None:
            losses = result.losses
            values = {
                "grad_norm": result.grad_norm,
                "num_zeros": result.num_zeros,
                "skipped": result.skipped,
                **values,
            }
        values = {"learning_rate": None, "grad_norm": None, "skipped": False, **values}
        log = self.config.log
        is_log = iteration % log.log_interval == 0 or iteration in (1, self.config.train_iters)
        if log.log_params_norm and is_log and model is not None:
            values.setdefault("params_norm", params_norm(model))
        return self.log.on_iteration(
            iteration,
            losses=losses or {},
            global_batch_size=batch_size,
            consumed_samples=state.consumed_samples,
            **values,
        )


def params_norm(model: nn.Module) -> torch.Tensor:
    """L2 norm of all parameters (device tensor, ``log_params_norm``)."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return torch.linalg.vector_norm(torch.stack(norms))


__all__ = ["ShellLog", "params_norm"]
