"""Observability flags the trainer composes (sinks, timers, stragglers, memory, energy, dumps)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from stalwart.config.checks import bounds, check_fields, parse_enum
from stalwart.observability.memory_release import validate_empty_unused_memory_level
from stalwart.observability.profiler import validate_profile_window
from stalwart.observability.sinks import WandbMode
from stalwart.observability.timers import TimingLogOption, TimingMode, validate_timing_flags


@dataclass(kw_only=True, frozen=True)
class ObservabilityConfig:
    """Where metrics go and which optional probes run. Everything here is off by default.

    Frozen; the modes are enums from construction on: ``timing_mode`` a :class:`TimingMode`,
    ``timing_log_option`` a :class:`TimingLogOption`, ``wandb_mode`` a :class:`WandbMode` (or
    None). A value from the CLI or TOML (``"events"``) is converted once, here, with the flag
    named on anything else.
    """

    metrics_file: str | None = None
    run_dir: str | None = None
    tensorboard_dir: str | None = None
    # --group-metric-tags: "<group>/<key>" TensorBoard/W&B tags instead of Megatron's flat keys.
    group_metric_tags: bool = False
    tensorboard_queue_size: int = field(default=1000, metadata=bounds(ge=1))
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: WandbMode | None = None
    timing_log_level: int = 0
    timing_log_option: TimingLogOption = TimingLogOption.MINMAX
    timing_mode: TimingMode = TimingMode.SYNC
    log_straggler: bool = False
    disable_straggler_on_startup: bool = False  # on/off at runtime: <run dir>/straggler.toggle
    straggler_threshold: float = field(default=1.2, metadata=bounds(gt=1.0))
    straggler_minmax_count: int = field(default=1, metadata=bounds(ge=1))
    log_memory_interval: int = field(default=0, metadata=bounds(ge=0))
    log_memory_to_tensorboard: bool = False
    log_energy: bool = False
    dump_dir: str | None = None
    save_activations_interval: int = field(default=0, metadata=bounds(ge=0))
    log_dgrads: bool = False
    log_tokens_per_expert: bool = False
    dump_stats_only: bool = False
    # Megatron's dump intervals (0: off), each on its own cadence.
    save_dgrads_interval: int = field(default=0, metadata=bounds(ge=0))
    save_wgrads_interval: int = field(default=0, metadata=bounds(ge=0))
    save_tokens_per_expert_interval: int = field(default=0, metadata=bounds(ge=0))
    save_params_interval: int = field(default=0, metadata=bounds(ge=0))
    empty_unused_memory_level: int = field(default=0, metadata=bounds(ge=0, le=2))
    # --log-progress: Megatron's <save>/progress.txt (stalwart.observability.progress_log).
    log_progress: bool = False
    profile: bool = False
    profile_step_start: int = field(default=10, metadata=bounds(ge=0))
    profile_step_end: int = field(default=12, metadata=bounds(ge=0))
    profile_ranks: list[int] = field(default_factory=lambda: [0], metadata=bounds(ge=0))
    use_pytorch_profiler: bool = False
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        # The one conversion of each mode (a frozen dataclass sets it through object.__setattr__).
        object.__setattr__(self, "timing_mode", parse_timing_mode(self.timing_mode))
        option = parse_enum(self.timing_log_option, TimingLogOption, "--timing-log-option")
        object.__setattr__(self, "timing_log_option", option)
        if self.wandb_mode is not None:
            object.__setattr__(
                self, "wandb_mode", parse_enum(self.wandb_mode, WandbMode, "--wandb-mode")
            )
        check_fields(self)  # after the conversions: the fields hold enums from here on
        validate_timing_flags(self.timing_log_level, self.timing_log_option)
        if self.disable_straggler_on_startup and not self.log_straggler:
            raise ValueError("--disable-straggler-on-startup needs --log-straggler")
        if self.profile:
            validate_profile_window(
                self.profile_step_start, self.profile_step_end, self.profile_ranks
            )
        validate_empty_unused_memory_level(self.empty_unused_memory_level)

    def check_extras(self) -> None:
        """Every flag that needs an optional package must find it importable, checked before
        start-up (before the model is built); ``ValueError`` naming the flag and the
        ``pip install 'stalwart[...]'`` to run. The progress bar (tqdm) and the report's
        plotly/matplotlib have fallbacks and are not checked."""
        wanted = (
            ("--tensorboard-dir", self.tensorboard_dir is not None, "torch.utils.tensorboard",
             "tensorboard", "tensorboard"),
            ("--wandb-project", self.wandb_project is not None, "wandb", "wandb", "wandb"),
            ("--log-energy", self.log_energy, "pynvml", "nvidia-ml-py", "nvml"),
        )  # fmt: skip
        for flag, used, module, package, extra in wanted:
            if not used:
                continue
            try:
                importlib.import_module(module)
            except Exception as exc:  # missing, or installed but broken (its own import fails)
                raise ValueError(
                    f"{flag} needs the {package!r} package ({type(exc).__name__}: {exc}): "
                    f"pip install 'stalwart[{extra}]'"
                ) from None


def parse_timing_mode(value: TimingMode | str) -> TimingMode:
    """``--timing-mode``: a :class:`TimingMode` or its value; ``ValueError`` naming the flag."""
    return parse_enum(value, TimingMode, "--timing-mode")
