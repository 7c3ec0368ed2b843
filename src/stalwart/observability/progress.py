"""The interactive progress bar: rate, tokens/s, elapsed, ETA, loss and validation loss.

Shown only when enabled; ``enabled=None`` means "only when the stream is a terminal", so batch
jobs, pipes and CI logs never get carriage-return noise (they keep the plain iteration lines). The
training log enables it on rank 0 only. A disabled bar does nothing.

Rendering uses `tqdm <https://tqdm.github.io>`_ when it is installed (``pip install
'stalwart[progress]'``): ``67%|██████▋   | 100/150 [00:12<00:06, 8.12it/s, tok/s 33.3k, lm loss
4.21, val 4.30]``. Without it a plain line with the same fields is drawn in place. Lines printed
through :meth:`ProgressBar.write` / :meth:`ProgressBar.external_write`, and every record of the
root logger's stream handlers while the bar is open, appear *above* the bar instead of over it::

    bar = ProgressBar(total=1000, tokens_per_iteration=32 * 1024)
    for it in range(1, 1001):
        ...
        bar.update(it)
        if it % 100 == 0:
            bar.set_stats(loss=loss_value)
            bar.write(f"iteration {it}")     # printed above the bar
    bar.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO


def _tqdm_class() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # optional dependency: fall back to the plain line
        return None
    return tqdm


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _terminal_columns(stream: TextIO) -> int | None:
    """The terminal width of ``stream`` (None when it is not a terminal or cannot say)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


class _AboveBarHandler(logging.Handler):
    """Wraps a stream handler: each record is written with the bar lifted out of the way."""

    def __init__(self, inner: logging.Handler, bar: ProgressBar) -> None:
        super().__init__(inner.level)
        self.inner = inner
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        with self.bar.external_write():
            self.inner.handle(record)


class ProgressBar:
    """One progress line for ``total`` iterations (see the module docstring).

    Args:
        total: iterations of the whole run (the bar's 100 %).
        enabled: True / False, or None for "only if ``stream`` is a terminal".
        stream: where the bar is drawn (default stdout).
        tokens_per_iteration: tokens one iteration trains on (global batch × sequence length);
            None leaves tokens/s out. Can change later (batch-size ramp) via :meth:`set_stats`.
        use_tqdm: None picks tqdm when installed; False forces the plain line.
        min_interval_s: redraw at most this often (the last iteration always draws), so the hot
            loop pays a clock read per iteration.

    Rate and ETA count only iterations run by this process: the first :meth:`update` (e.g. at a
    resumed iteration) starts the clock.
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        tokens_per_iteration: int | None = None,
        use_tqdm: bool | None = None,
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
        self.tokens_per_iteration = tokens_per_iteration
        # A terminal that reports 0 columns (a pty nobody sized) gets the plain line: tqdm's
        # dynamic width would draw nothing at all there.
        use_tqdm = use_tqdm if _terminal_columns(self.stream) != 0 else False
        self._tqdm_cls = _tqdm_class() if enabled and use_tqdm is not False else None
        self._tqdm: Any = None
        self._start: tuple[float, int] | None = None  # (time, iteration) of the first update
        self._last_draw = float("-inf")
        self._current = 0
        self._suffix = ""
        self._stats: dict[str, float] = {}
        self._visible = False
        self._done = False  # closed: never drawn again
        self._handlers: list[tuple[logging.Handler, _AboveBarHandler]] = []

    @property
    def uses_tqdm(self) -> bool:
        """Whether the bar is drawn by tqdm (False: the plain line, or disabled)."""
        return self._tqdm_cls is not None

    # ----------------------------------------------------------------- state
    def update(self, current: int, suffix: str | None = None) -> None:
        """Set progress to ``current`` (of ``total``) and redraw if due (not after `close`)."""
        if not self.enabled or self._done:
            return
        now = time.monotonic()
        if self._start is None:
            self._open(now, current)
        self._current = current
        if suffix is not None:
            self._suffix = suffix
        if current < self.total and now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        self._draw(now)

    def set_stats(
        self,
        *,
        loss: float | None = None,
        val_loss: float | None = None,
        tokens_per_iteration: int | None = None,
        loss_name: str = "loss",
    ) -> None:
        """Latest training loss / validation loss shown on the bar (None leaves a value as is)."""
        if loss is not None:
            self._stats[loss_name] = loss
        if val_loss is not None:
            self._stats["val"] = val_loss
        if tokens_per_iteration is not None:
            self.tokens_per_iteration = tokens_per_iteration

    def rate(self, now: float | None = None) -> float | None:
        """Iterations per second since the first update (None before two distinct updates)."""
        if self._start is None:
            return None
        t0, it0 = self._start
        elapsed = (time.monotonic() if now is None else now) - t0
        done = self._current - it0
        return done / elapsed if elapsed > 0 and done > 0 else None

    def _postfix(self, rate: float | None) -> str:
        parts = []
        if rate is not None and self.tokens_per_iteration:
            parts.append(f"tok/s {_si(rate * self.tokens_per_iteration)}")
        parts += [f"{k} {v:.4g}" for k, v in self._stats.items()]
        if self._suffix:
            parts.append(self._suffix)
        return ", ".join(parts)

    # ----------------------------------------------------------------- drawing
    def render(self) -> str:
        """The plain bar text for the current state (no control characters)."""
        frac = min(max(self._current / self.total, 0.0), 1.0)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        digits = len(str(self.total))
        text = f"[{bar}] {self._current:>{digits}d}/{self.total} {frac * 100:5.1f}%"
        now = time.monotonic()
        rate = self.rate(now)
        if self._start is not None:
            elapsed = now - self._start[0]
            eta = (self.total - self._current) / rate if rate else None
            text += f" [{_clock(elapsed)}<{_clock(eta) if eta is not None else '?'}"
            text += f", {rate:.2f} it/s]" if rate else "]"
        postfix = self._postfix(rate)
        return f"{text}  {postfix}" if postfix else text

    def _open(self, now: float, current: int) -> None:
        self._start = (now, current)
        if self._tqdm_cls is not None:
            self._tqdm = self._tqdm_cls(
                total=self.total,
                initial=current,
                file=self.stream,
                dynamic_ncols=True,
                mininterval=self.min_interval_s,
                smoothing=0.1,
                leave=True,
            )
        self._redirect_logging()

    def _draw(self, now: float) -> None:
        if self._tqdm is not None:
            bar = self._tqdm
            rate = bar.format_dict.get("rate") or self.rate(now)
            bar.set_postfix_str(self._postfix(rate), refresh=False)
            bar.update(self._current - bar.n)
            bar.refresh()
        else:
            self.stream.write("\r\x1b[2K" + self.render())
            self.stream.flush()
        self._visible = True

    def write(self, text: str) -> None:
        """Print ``text`` on its own line above the bar (plain print when disabled)."""
        with self.external_write():
            self.stream.write(text + "\n")
            self.stream.flush()

    @contextlib.contextmanager
    def external_write(self) -> Iterator[None]:
        """Lift the bar while the body prints to the terminal, then draw it again below."""
        if not (self.enabled and self._visible):
            yield
            return
        if self._tqdm is not None:
            with self._tqdm.external_write_mode(file=self.stream):
                yield
            return
        self.stream.write("\r\x1b[2K")
        self.stream.flush()
        try:
            yield
        finally:
            self._draw(time.monotonic())

    def clear(self) -> None:
        """Erase the bar so a normal line can be printed; the next update redraws it."""
        if self.enabled and self._visible:
            if self._tqdm is not None:
                self._tqdm.clear()
            else:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
            self._visible = False
            self._last_draw = float("-inf")

    def close(self) -> None:
        """Leave the final bar on its own line and give the logging handlers back; the bar is
        not drawn again (later updates do nothing)."""
        self._done = True
        self._restore_logging()
        if not self.enabled or self._start is None:
            return
        if self._tqdm is not None:
            self._draw(time.monotonic())
            self._tqdm.close()
            self._tqdm = None
        elif self._visible:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self._visible = False
        self._start = None

    # ----------------------------------------------------------------- logging
    def _redirect_logging(self) -> None:
        """Route the root logger's stream handlers through the bar while it is open."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            ):
                wrapper = _AboveBarHandler(handler, self)
                root.removeHandler(handler)
                root.addHandler(wrapper)
                self._handlers.append((handler, wrapper))

    def _restore_logging(self) -> None:
        root = logging.getLogger()
        for handler, wrapper in self._handlers:
            root.removeHandler(wrapper)
            root.addHandler(handler)
        self._handlers = []
