"""Observability flags the trainer composes (sinks, timers, stragglers, memory, energy, dumps)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stalwart.observability.memory_release import validate_empty_unused_memory_level
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
    # Megatron parity (cli/args.py `_megatron_parity_flags`).
    save_wgrads_interval: int = 0
    save_params_interval: int = 0
    empty_unused_memory_level: int = 0
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
        _check_megatron_parity_fields(self)


def _check_megatron_parity_fields(config: ObservabilityConfig) -> None:
    """``--save-wgrads-interval``, ``--save-params-interval``: integers >= 0 (0: off);
    ``--empty-unused-memory-level``: 0, 1 or 2."""
    validate_empty_unused_memory_level(config.empty_unused_memory_level)
    for flag, value in (
        ("--save-wgrads-interval", config.save_wgrads_interval),
        ("--save-params-interval", config.save_params_interval),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{flag} must be an integer >= 0 (0: off), got {value!r}")
