"""Standard output (and error) whose reader went away (``stalwart goodput --json | head``).

Python ignores ``SIGPIPE``, so a write to a pipe whose reader closed raises ``BrokenPipeError``
wherever the process happens to print: the end of ``stalwart goodput``, the middle of a
``--print-config``, an iteration line of a training run (which then died with a traceback and
without its checkpoint), the interpreter's final flush. The process entry
(:func:`stalwart.__main__.run`) installs :class:`ClosedPipeSafeStream` on stdout and on stderr
(``2>&1 | head``: a one-line error must still exit 2), for every command: at the first broken
pipe it does what Python's documentation advises (point the file descriptor at ``os.devnull``:
later writes and the final flush go nowhere, quietly) and carries on, so a command ends with its own
exit code and a training run still saves.

    >>> import io
    >>> out = ClosedPipeSafeStream(io.StringIO())
    >>> out.write("text")
    4
"""

from __future__ import annotations

import os
from typing import Any, TextIO

__all__ = ["ClosedPipeSafeStream"]


class ClosedPipeSafeStream:
    """A ``sys.stdout`` / ``sys.stderr`` stand-in: ``write``/``flush`` of ``stream``; a
    ``BrokenPipeError`` points the stream's descriptor at ``os.devnull`` (what is lost was unread
    anyway)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.closed_pipe = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        self.closed_pipe = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)
