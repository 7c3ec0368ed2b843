"""A dependency-free, single-line progress bar for interactive runs (the demo).

Shown only when enabled; ``enabled=None`` means "only when the stream is a TTY", so batch jobs,
pipes and CI logs never get carriage-return noise. A disabled bar does nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``[#####.....]  120/1000  12.0%  <suffix>`` redrawn in place on ``stream``.

    Redraws are throttled to ``min_interval_s`` (the last iteration always draws) so the hot loop
    pays only a clock read. Call :meth:`clear` before printing a normal line, :meth:`close` at the end.
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        width: int = 30,
        min_interval_s: float = 0.1,
    ) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stdout
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.enabled = enabled
        self.total = max(int(total), 1)
        self.width = width
        self.min_interval_s = min_interval_s
        self._last_draw = float("-inf")
        self._current = 0
        self._suffix = ""
        self._visible = False

    def update(self, current: int, suffix: str | None = None) -> None:
        """Set progress to ``current`` (of ``total``) and redraw if due."""
        if not self.enabled:
            return
        self._current = current
        if suffix is not None:
            self._suffix = suffix
        now = time.monotonic()
        if current < self.total and now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        self._draw()

    def render(self) -> str:
        """The bar text for the current state (no control characters)."""
        frac = min(max(self._current / self.total, 0.0), 1.0)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        digits = len(str(self.total))
        text = f"[{bar}] {self._current:>{digits}d}/{self.total} {frac * 100:5.1f}%"
        return f"{text}  {self._suffix}" if self._suffix else text

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self.render())
        self.stream.flush()
        self._visible = True

    def clear(self) -> None:
        """Erase the bar so a normal line can be printed; the next update redraws it."""
        if self.enabled and self._visible:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._visible = False
            self._last_draw = float("-inf")

    def close(self) -> None:
        """Leave the final bar on its own line."""
        if self.enabled and self._visible:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self._visible = False
