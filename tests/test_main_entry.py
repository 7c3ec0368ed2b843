"""The process entry point (``python -m stalwart``, the ``stalwart`` script): main's exit code,
then the collector frozen so that the interpreter's exit skips walking torch's import graph."""

from __future__ import annotations

import gc

import stalwart.__main__ as entry


def test_run_returns_mains_code_and_freezes_the_collector(monkeypatch) -> None:
    monkeypatch.setattr(entry, "main", lambda: 3)
    before = gc.get_freeze_count()
    try:
        assert entry.run() == 3
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
