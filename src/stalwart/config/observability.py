"""Observability flags the trainer composes (sinks, timers, stragglers, memory, energy, dumps)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stalwart.observability.profiler import validate_profile_window


@dataclass(kw_only=True)
class ObservabilityConfig:
    """Where metrics go and which optional probes run. Everything here is off by default."""

    metrics_file: str | None = None
    run_dir: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: str | None = None
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    timing_mode: str = "sync"
    log_straggler: bool = False
    straggler_threshold: float = 1.2
    log_memory_interval: int = 0
    log_memory_to_tensorboard: bool = False
    log_energy: bool = False
    dump_dir: str | None = None
    save_activations_interval: int = 0
    log_dgrads: bool = False
    log_tokens_per_expert: bool = False
    dump_stats_only: bool = False
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if self.profile:
            validate_profile_window(
                self.profile_step_start, self.profile_step_end, self.profile_ranks
            )
        if self.timing_mode not in ("sync", "events"):
            raise ValueError(f"--timing-mode: got {self.timing_mode!r}, allowed: sync, events")
        if self.straggler_threshold <= 1.0:
            raise ValueError(
                f"--straggler-threshold must be > 1.0 (got {self.straggler_threshold})"
            )
        if self.log_memory_interval < 0:
            raise ValueError(f"--log-memory-interval must be >= 0 (got {self.log_memory_interval})")
        if self.save_activations_interval < 0:
            raise ValueError("--save-activations-interval must be >= 0")
