"""The process entry point (``python -m stalwart``, the ``stalwart`` script): main's exit code,
then the collector frozen so that the interpreter's exit skips walking torch's import graph."""

from __future__ import annotations

import gc

import pytest

import stalwart.__main__ as entry
from stalwart.distributed import torchrun


def test_run_returns_mains_code_and_freezes_the_collector(monkeypatch) -> None:
    monkeypatch.setattr(entry, "main", lambda: 3)
    before = gc.get_freeze_count()
    try:
        assert entry.run() == 3
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_torchrun_wrapper_keeps_torchruns_exit_and_freezes(monkeypatch) -> None:
    calls = []

    def fake_run_module(name: str, **kwargs) -> None:
        calls.append((name, kwargs))
        raise SystemExit(1)  # what torchrun does when a worker failed

    monkeypatch.setattr(torchrun.runpy, "run_module", fake_run_module)
    before = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as exc:
            torchrun.main()
        assert exc.value.code == 1
        assert calls == [("torch.distributed.run", {"run_name": "__main__", "alter_sys": True})]
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
