"""How each path names the shell's settings: a refusal, an exit's reason or a skip line names
the setting as the user wrote it, never another path's spelling.

The CLI spells Megatron's flags (``--save-interval``); a hand-written loop the config's field
(``ShellConfig.exit.save_interval``); the adapters their own keywords
(``StalwartCallback(exit=ExitConfig(save_interval=...))``, the framework's ``max_steps``)::

    >>> Names.CLI.spell("exit.save_interval"), Names.LOOP.spell("exit.save_interval")
    ('--save-interval', 'ShellConfig.exit.save_interval')
    >>> Names.LIGHTNING.spell("rerun.iterations_to_skip")
    'StalwartCallback(rerun=RerunConfig(iterations_to_skip=...))'
    >>> Names.HF.spell("train_iters")
    'TrainingArguments(max_steps=...)'

A path is the dotted name of a :class:`~stalwart.loop.ShellConfig` field: ``"train_iters"``, or
``"<sub-config>.<field>"``. ``tests/loop/test_naming.py`` checks that every CLI spelling is a
flag of ``stalwart train`` (or a field the CLI has no flag for, spelled as its config's).
"""

from __future__ import annotations

import enum

# ShellConfig fields whose flag is not "--" + the field's name (negated switches, renames).
_FLAGS = {
    "save_dir": "--save",
    "ft.timeouts": "--ft-timeouts",
    "rerun.check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
    "log.log_progress_bar": "--no-progress-bar",
    "log.log_every_iteration": "--no-log-every-iteration",
    "log.log_loss_scale_to_tensorboard": "--no-log-loss-scale-to-tensorboard",
}
# ShellConfig fields the CLI has no flag for: spelled as their config's field.
_NO_FLAG = frozenset(
    {"goodput", "log.log_timestamp", "rerun.error_injection_seed", "rerun.spiky_loss_factor"}
    | {"rerun.large_grads_factor", "ft.safety_factor", "ft.blend_alpha", "ft.kill_grace_s"}
    | {"ft.min_learned_timeout_s", "ft.min_steps_for_step_update", "ft.poll_interval_s"}
    | {"ft.stack_dump_signal", "ft.stack_dump_wait_s", "ft.abort_grace_s"}
)
# The framework's own setting for the shell's top-level fields (the rest are the callback's).
_FRAMEWORK = {
    "lightning": {
        "train_iters": "Trainer(max_steps=...)",
        "save_dir": "StalwartCallback(save_dir)",
    },
    "hf": {
        "train_iters": "TrainingArguments(max_steps=...)",
        "save_dir": "StalwartCallback(save_dir=...)",
    },
}


# The class of each ``ShellConfig.<section>``, by its field name. Written out here, not read off
# ShellConfig, because shell_config imports this module (tests/loop/test_naming.py checks that
# the two agree).
SECTION_CLASSES: tuple[tuple[str, str], ...] = (
    ("sinks", "SinkConfig"),
    ("timers", "TimerConfig"),
    ("straggler", "StragglerConfig"),
    ("memory", "MemoryConfig"),
    ("energy", "EnergyConfig"),
    ("dumps", "TensorDumpConfig"),
    ("profiler", "ProfilerConfig"),
    ("memory_release", "MemoryReleaseConfig"),
    ("progress", "ProgressLogConfig"),
    ("exit", "ExitConfig"),
    ("ft", "FaultToleranceConfig"),
    ("rerun", "RerunConfig"),
    ("log", "LogConfig"),
)


def _config_class(section: str) -> str:
    """The class name of ``ShellConfig.<section>`` (``exit`` -> ``ExitConfig``)."""
    return dict(SECTION_CLASSES)[section]


class Names(enum.Enum):
    """The four ways a path spells a shell setting (see the module docstring)."""

    CLI = "cli"
    LOOP = "loop"
    LIGHTNING = "lightning"
    HF = "hf"

    def spell(self, path: str) -> str:
        """``path`` (``"exit.save_interval"``, ``"train_iters"``) as this path writes it."""
        section, _, name = path.rpartition(".")
        if self is Names.CLI:
            if path in _FLAGS:
                return _FLAGS[path]
            if path not in _NO_FLAG:
                return "--" + name.replace("_", "-")
            return f"{_config_class(section)}.{name}" if section else f"ShellConfig.{name}"
        if self is Names.LOOP:
            return f"ShellConfig.{path}"
        if not section:
            return _FRAMEWORK[self.value].get(name, f"StalwartCallback({name}=...)")
        return f"StalwartCallback({section}={_config_class(section)}({name}=...))"


__all__ = ["Names"]
