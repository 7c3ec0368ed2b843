"""Log records a person at the terminal sees by default (a leaf: it imports nothing of stalwart).

``stalwart train`` shows warnings and errors by default, and of the INFO records only the few
marked as notices: the checkpoints saved and loaded, a CUDA graph captured, learned hang
timeouts in use, a profiler trace written. ``--verbose``
shows every INFO record; ``--logging-level`` sets the level exactly (a notice is an INFO record
then, shown from level 20 down). Mark a record with ``extra=NOTICE``::

    logger.info("saved checkpoint iteration %d to %s", it, path, extra=NOTICE)

A library user's own logging configuration sees an ordinary INFO record.
"""

from __future__ import annotations

import logging
import types

NOTICE = types.MappingProxyType({"stalwart_notice": True})  # read-only: ``extra=NOTICE``


def is_notice(record: logging.LogRecord) -> bool:
    """Whether ``record`` was logged with ``extra=NOTICE``."""
    return bool(getattr(record, "stalwart_notice", False))


class WarningsAndNotices(logging.Filter):
    """The default terminal: records at WARNING and above, and INFO notices."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or is_notice(record)


class NoticeFormatter(logging.Formatter):
    """``fmt`` for every record but a notice, which is its message alone (a line of the run's,
    as the log line is: no level and logger name in front)."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if is_notice(record) else super().format(record)


__all__ = ["NOTICE", "NoticeFormatter", "WarningsAndNotices", "is_notice"]
