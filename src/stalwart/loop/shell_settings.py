"""What the shell around a training step does (its settings): the components' own configs,
composed; :class:`~stalwart.loop.ShellConfig` adds the one way to build the shell from them.

Each probe keeps its config beside it (``StragglerConfig`` in ``observability/straggler.py``,
...), one field per Megatron flag, each with ``build()``. ``ProbeConfigs`` declares them once:
``ShellConfig`` and the trainer's ``RunConfig`` both derive from it (``RunConfig.shell_config``
hands them over); the Lightning and HF callbacks take them as keyword arguments; a hand-written
loop builds this directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from stalwart.loop.naming import Names
from stalwart.observability.dumps import TensorDumpConfig
from stalwart.observability.energy import EnergyConfig
from stalwart.observability.memory import MemoryConfig, validate_memory_args
from stalwart.observability.memory_release import MemoryReleaseConfig
from stalwart.observability.profiler import ProfilerConfig
from stalwart.observability.progress_log import ProgressLogConfig
from stalwart.observability.sinks import SinkConfig
from stalwart.observability.straggler import StragglerConfig
from stalwart.observability.timers import TimerConfig
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.hang.sections import FaultToleranceConfig
from stalwart.reliability.rerun import RerunConfig, RerunMode


@dataclass(kw_only=True, frozen=True)
class ProbeConfigs:
    """The probes' configs, declared once: ``ShellConfig`` and the trainer's ``RunConfig``
    hold the same fields (each a component's config, everything off by default)."""

    sinks: SinkConfig = field(default_factory=SinkConfig)
    timers: TimerConfig = field(default_factory=TimerConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    dumps: TensorDumpConfig = field(default_factory=TensorDumpConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    memory_release: MemoryReleaseConfig = field(default_factory=MemoryReleaseConfig)
    progress: ProgressLogConfig = field(default_factory=ProgressLogConfig)


# The probe configs, by their field name (the parity test walks every field of each).
PROBES: tuple[str, ...] = tuple(f.name for f in fields(ProbeConfigs))


@dataclass(kw_only=True, frozen=True)
class ShellSettings(ProbeConfigs):
    """What the shell does (each component config validates itself); users build
    :class:`~stalwart.loop.ShellConfig`, these settings with its ``build``.

    Attributes:
        train_iters: the run's iterations (the log line's total; the exit's ``finished``).
        save_dir: where ``exit_reason.json``, ``ft_state.json``, ``rerun_verdict.json`` and
            ``progress.txt`` go (the loop's or the framework's checkpoint directory).
        run_dir: metrics.jsonl, goodput.jsonl, memory.json, straggler.jsonl, dumps, profiles
            (default: ``save_dir``).
        goodput: keep the goodput ledger (rank 0, needs a run directory).
        seq_length: tokens per sample (tokens/s in the log line).
        exit / ft / rerun / log: the signal/duration/interval exits (default: the SIGTERM
            handler on), hang detection, the rerun machine (default: disabled), the log line.
        sinks / timers / straggler / memory / energy / dumps / profiler / memory_release /
            progress: the probes (:class:`ProbeConfigs`), everything off by default.
    """

    train_iters: int
    save_dir: str | None = None
    run_dir: str | None = None
    goodput: bool = True
    seq_length: int | None = None
    exit: ExitConfig = field(default_factory=ExitConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    # Disabled unless asked for; a framework draws its own progress bar.
    rerun: RerunConfig = field(default_factory=lambda: RerunConfig(rerun_mode=RerunMode.DISABLED))
    log: LogConfig = field(
        default_factory=lambda: LogConfig(log_interval=10, log_progress_bar=False)
    )

    def __post_init__(self) -> None:
        if isinstance(self.train_iters, bool) or not isinstance(self.train_iters, int):
            raise ValueError(f"ShellConfig.train_iters: an integer >= 1, got {self.train_iters!r}")
        if self.train_iters < 1:
            raise ValueError(f"ShellConfig.train_iters: an integer >= 1, got {self.train_iters}")

    @property
    def artefact_dir(self) -> str | None:
        """Where run artefacts go: ``run_dir``, else ``save_dir``, else nowhere."""
        return self.run_dir or self.save_dir

    def check(
        self,
        names: Names = Names.LOOP,
        *,
        device: torch.device | None = None,
        world_size: int | None = None,
    ) -> None:
        """Every rule between the shell's settings (with ``device`` and ``world_size``: also
        what the job must have), raised as one ``ValueError`` naming the settings as ``names``
        spells them. The shell checks before it builds or writes anything, so a refused start
        leaves nothing behind; the CLI checks before its first line; an adapter when built."""
        spell = names.spell
        for path, value, why in (
            ("progress.log_progress", self.progress.log_progress, "progress.txt is written there"),
            ("exit.save_interval", self.exit.save_interval, "a checkpoint directory"),
            (
                "exit.non_persistent_save_interval",
                self.exit.non_persistent_save_interval,
                "its directory defaults to <save>/non_persistent",
            ),
            (
                "rerun.error_injection_once",
                self.rerun.error_injection_once,
                "the fired-once markers live there",
            ),
        ):
            if value and not self.save_dir:
                raise ValueError(f"{spell(path)} needs {spell('save_dir')} ({why})")
        signals = (spell("exit.exit_signal"), spell("ft.stack_dump_signal"))
        self.ft.check_exit_signal(self.exit.signal_enum, signals)
        intervals = (spell("memory.log_memory_interval"), spell("log.log_interval"))
        validate_memory_args(self.log.log_interval, self.memory.log_memory_interval, intervals)
        if device is not None:
            self.profiler.check(device, world_size or 1, lambda f: spell(f"profiler.{f}"))
        self.check_extras(names)

    def refuse_without_step(self, names: Names, *, skips: bool) -> None:
        """Settings that only the guarded step can honour, refused in one line (``ValueError``)
        on a path without it (a framework's own step). ``skips``: iterations to skip (the
        setting's and the tracker file's)."""
        spell = names.spell
        needs = {
            "tensor dumps (they hook each micro-batch's forward and backward)": (
                self.dumps.dump_config(log_interval=1).any_enabled
            ),
            f"{spell('log.log_num_zeros_in_grad')} (it counts the gradients the step clips)": (
                self.log.log_num_zeros_in_grad
            ),
            f"{spell('rerun.iterations_to_skip')} (the step consumes a skipped iteration's "
            "batch without training)": skips,
            f"{spell('rerun.rerun_mode')} {self.rerun.mode.value} (the rerun machine replays "
            "the step it owns)": self.rerun.mode is not RerunMode.DISABLED,
        }
        for what, wanted in needs.items():
            if wanted:
                raise ValueError(
                    f"{what}: needs the guarded step (GuardedModule, StalwartTrainer, Shell.step)"
                )

    def check_extras(self, names: Names = Names.CLI) -> None:
        """Every setting that needs an optional package finds it importable, checked before
        anything is built (``ValueError`` naming the setting and the ``pip install`` to run)."""
        self.sinks.check_extras(lambda f: names.spell(f"sinks.{f}"))
        self.energy.check_extras(lambda f: names.spell(f"energy.{f}"))


__all__ = ["PROBES", "ProbeConfigs", "ShellSettings"]
