"""Hang-detection settings: sections, per-section timeouts, ``--ft-timeouts`` parsing and the
config.

:mod:`stalwart.reliability.hang.sections` re-exports the config names (the README's entry point).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field, replace
from enum import Enum

from stalwart.reliability.hang import monitor as hb
from stalwart.reliability.hang.tiers import Escalation

FT_STATE_FILENAME = "ft_state.json"
FT_LOG_DIRNAME = "ft_logs"
FT_STATE_VERSION = 1
_TIMEOUT_KEYS = ("setup", "step", "checkpointing", "out_of_section")
_DUMP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGHUP")


class Section(Enum):
    """Timed sections. ``index`` is the section's id in the heartbeat record."""

    SETUP = "setup"
    STEP = "step"
    CHECKPOINTING = "checkpointing"

    @property
    def index(self) -> int:
        return hb.SECTION_NAMES.index(self.value)


@dataclass(frozen=True)
class SectionTimeouts:
    """Timeouts in seconds per section, plus the out-of-section timeout."""

    setup: float = 600.0
    step: float = 180.0
    checkpointing: float = 420.0
    out_of_section: float = 600.0

    def __post_init__(self) -> None:
        for key in _TIMEOUT_KEYS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"--ft-timeouts: {key} must be a finite number of seconds > 0, got {value!r}"
                )

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.setup, self.step, self.checkpointing, self.out_of_section)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(_TIMEOUT_KEYS, self.as_tuple()))


def parse_ft_timeouts(text: str, base: SectionTimeouts | None = None) -> SectionTimeouts:
    """Parse ``--ft-timeouts`` (``"setup=600,step=180,checkpointing=420,out_of_section=600"``).

    Keys may be given in any order and subset (missing keys keep ``base``, default the built-in
    timeouts); ``key:seconds`` (NVRx's spelling) is accepted too. Raises ValueError naming the flag,
    the allowed keys and the format on anything else.
    """
    usage = f"expected comma-separated key=seconds with keys {', '.join(_TIMEOUT_KEYS)}"
    values: dict[str, float] = {}
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"--ft-timeouts: empty entry in {text!r}; {usage}")
    for item in items:
        key, sep, raw = item.replace(":", "=", 1).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _TIMEOUT_KEYS:
            raise ValueError(f"--ft-timeouts: bad entry {item!r}; {usage}")
        if key in values:
            raise ValueError(f"--ft-timeouts: {key} given twice in {text!r}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"--ft-timeouts: {key}={raw.strip()!r} is not a number; {usage}"
            ) from None
        values[key] = value
    return replace(base or SectionTimeouts(), **values)


def _finite(value: object, minimum: float) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= minimum
    )


def _int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Hang-detection settings (Megatron/NVRx flag spelling in error messages).

    Attributes:
        enable_ft: start a monitor process per rank (``--enable-ft``).
        timeouts: per-section timeouts (``--ft-timeouts``).
        calc_ft_timeouts: learn timeouts from observed durations (``--calc-ft-timeouts``).
        ft_num_warmup_iters: train/eval steps per phase that are not ``step`` sections.
        safety_factor: learned timeout = factor × observed max (NVRx default 5).
        blend_alpha: weight of the previous learned value when re-learning (NVRx EMA 0.5).
        min_learned_timeout_s: floor for learned timeouts (a 0.1 s step must not yield 0.5 s).
        min_steps_for_step_update: timed steps needed before ``step`` is learned (Megatron: 16).
        poll_interval_s: monitor polling period; detection latency is timeout + this.
        stack_dump_signal: signal the monitor sends for a faulthandler stack dump. It must
            differ from ``--exit-signal`` (see `check_exit_signal`); SIGUSR1 is often SLURM's
            pre-timeout warning, hence SIGUSR2.
        kill_grace_s: SIGTERM grace before SIGKILL. 0 kills at once: a hung rank cannot run a
            SIGTERM handler usefully, and a flag-only handler would just waste the grace.
        stack_dump_wait_s: how long the monitor waits for the dump to arrive.
        abort_grace_s: after the hard tier aborted the process groups, how long the rank may
            take to exit by itself before it is killed (peers blocked in a collective return).
    """

    enable_ft: bool = False
    timeouts: SectionTimeouts = field(default_factory=SectionTimeouts)
    calc_ft_timeouts: bool = False
    ft_num_warmup_iters: int = 5
    safety_factor: float = 5.0
    blend_alpha: float = 0.5
    min_learned_timeout_s: float = 30.0
    min_steps_for_step_update: int = 16
    poll_interval_s: float = 1.0
    stack_dump_signal: str = "SIGUSR2"
    kill_grace_s: float = 0.0
    stack_dump_wait_s: float = 1.0
    abort_grace_s: float = 2.0

    def __post_init__(self) -> None:
        if not _int_at_least(self.ft_num_warmup_iters, 0):
            raise ValueError("--ft-num-warmup-iters: must be an integer >= 0")
        # The rest are fields a hand-written loop sets (NVRx's settings, not Megatron flags).
        seconds = ("min_learned_timeout_s", "kill_grace_s", "abort_grace_s", "stack_dump_wait_s")
        checks = (
            ("safety_factor", _finite(self.safety_factor, 1.0), "a number >= 1"),
            (
                "blend_alpha",
                _finite(self.blend_alpha, 0.0) and self.blend_alpha < 1.0,
                "a number in [0, 1)",
            ),
            (
                "min_steps_for_step_update",
                _int_at_least(self.min_steps_for_step_update, 1),
                "an integer >= 1",
            ),
            (
                "poll_interval_s",
                _finite(self.poll_interval_s, 0.0) and 0 < self.poll_interval_s <= 60,
                "a number in (0, 60]",
            ),
            *((name, _finite(getattr(self, name), 0.0), "a number >= 0") for name in seconds),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"FaultToleranceConfig.{name}: must be {allowed}")
        if self.stack_dump_signal not in _DUMP_SIGNALS:
            allowed = ", ".join(_DUMP_SIGNALS)
            raise ValueError(
                f"FaultToleranceConfig.stack_dump_signal: got {self.stack_dump_signal!r}, "
                f"allowed: {allowed}"
            )

    @property
    def escalation(self) -> Escalation:
        """The tiers' timing after a timeout: detection, dump, abort, kill."""
        return Escalation(
            self.poll_interval_s, self.stack_dump_wait_s, self.abort_grace_s, self.kill_grace_s
        )

    @property
    def dump_signal(self) -> signal.Signals:
        return signal.Signals[self.stack_dump_signal]

    def check_exit_signal(
        self, exit_signal: signal.Signals, names: tuple[str, str] | None = None
    ) -> None:
        """Raise ValueError if ``--exit-signal`` collides with the stack-dump signal
        (``names``: the two settings as the caller's path spells them)."""
        exit_name, dump_name = names or ("--exit-signal", "FaultToleranceConfig.stack_dump_signal")
        if self.enable_ft and exit_signal == self.dump_signal:
            raise ValueError(
                f"{exit_name}: {exit_signal.name} is used by hang detection for stack dumps "
                f"({dump_name}); choose another exit signal"
            )
