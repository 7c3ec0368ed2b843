"""What :meth:`stalwart.observability.timers.Timers.report` gathers (every rank's figures) and
Megatron's text and dashboard scalars made from it; ``--timing-log-option``'s values."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TimingLogOption(enum.Enum):
    """``--timing-log-option``: which figures across ranks the timer text shows."""

    MAX = "max"
    MINMAX = "minmax"
    ALL = "all"


def check_log_option(log_option: object) -> None:
    """``TypeError`` unless ``log_option`` is a :class:`TimingLogOption` (a string would
    silently print min/max for anything but a known value: parse it once)."""
    if not isinstance(log_option, TimingLogOption):
        raise TypeError(
            f"the timers' log option must be a TimingLogOption, got {log_option!r} "
            "(parse it once: TimingLogOption('max'))"
        )


@dataclass(frozen=True)
class TimerReport:
    """Per-rank milliseconds (already divided by the normalizer) for a list of timer names.

    ``ms[r][i]`` is rank ``r``'s value for ``names[i]``; 0 means "not timed on that rank" and is
    excluded from min/max, as in Megatron.
    """

    names: tuple[str, ...]
    ms: tuple[tuple[float, ...], ...]

    def min_max(self) -> dict[str, tuple[float, float]]:
        """Name -> (min, max) over ranks with a positive value; names without one are omitted."""
        out: dict[str, tuple[float, float]] = {}
        for i, name in enumerate(self.names):
            values = [row[i] for row in self.ms if row[i] > 0.0]
            if values:
                out[name] = (min(values), max(values))
        return out

    def format(self, log_option: TimingLogOption) -> str | None:
        """Megatron's text for ``MAX`` / ``MINMAX`` / ``ALL``; None when nothing was timed.

        Raises:
            TypeError: ``log_option`` is not a :class:`TimingLogOption`.
        """
        check_log_option(log_option)
        if log_option is TimingLogOption.ALL:
            return self._format_all()
        pairs = self.min_max()
        if not pairs:
            return None
        if log_option is TimingLogOption.MAX:
            text = "max time across ranks (ms):"
            for name, (_, hi) in pairs.items():
                text += "\n    " + (name + " ").ljust(48, ".") + f": {hi:.2f}"
        else:
            text = "(min, max) time across ranks (ms):"
            for name, (lo, hi) in pairs.items():
                text += "\n    " + (name + " ").ljust(48, ".") + f": ({lo:.2f}, {hi:.2f})"
        return text

    def _format_all(self) -> str | None:
        text = "times across ranks (ms):"
        found = False
        for i, name in enumerate(self.names):
            per_rank = [(r, row[i]) for r, row in enumerate(self.ms) if row[i] > 0.0]
            if not per_rank:
                continue
            found = True
            text += f"\n  {name}:"
            for r, value in per_rank:
                text += f"\n     rank {r:2d}: {value:.2f}"
        return text if found else None

    def scalars(self) -> dict[str, float]:
        """Metrics-file scalars: ``"<name>-time-ms"`` -> max over ranks (milliseconds)."""
        return {f"{name}-time-ms": hi for name, (_, hi) in self.min_max().items()}

    def megatron_scalars(self) -> dict[str, float]:
        """Dashboard scalars, Megatron's keys and unit: ``"<name>-time"`` -> max over ranks (s)."""
        return {f"{name}-time": hi / 1000.0 for name, (_, hi) in self.min_max().items()}


__all__ = ["TimerReport", "TimingLogOption", "check_log_option"]
