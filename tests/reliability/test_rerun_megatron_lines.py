"""The rerun machine's diagnosis lines match the regex Megatron's log scrapers use
(``Rank N, node ..., device N: Possible (transient|persistent) error!!``), on a real run with an
injected transient error and a real persistent-error sequence (exit 16 on one device, 17 on
another). In-process runs (the log records are the lines ``stalwart train`` writes to stderr)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.rerun import DEVICE_ID_ENV
from stalwart.train.trainer import run_training

from train_utils import make_config

# Megatron's functional tests (megatron-behaviour.md §1.1.6); the node part is a hostname.
MEGATRON = re.compile(
    r"Rank [0-9]+, node [^,\s]+, device [0-9]+: Possible (transient|persistent) error!!"
)


def _flags(save: Path, kind: str) -> list[str]:
    return ["--train-iters", "4", "--seed", "5", "--save", str(save), "--error-injection-rate",
            "1", "--error-injection-type", kind, "--error-injection-iterations", "3"]  # fmt: skip


def test_transient_error_line_matches_megatrons_regex(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    outcome = run_training(
        make_config(*_flags(tmp_path / "ckpt", "transient_error")), DistributedContext()
    )
    assert outcome.exit_code == 17, caplog.text[-3000:]
    found = [m.group(1) for m in MEGATRON.finditer(caplog.text)]
    assert found == ["transient"], caplog.text[-3000:]
    record = next(r for r in caplog.records if MEGATRON.search(r.getMessage()))
    line = record.getMessage()
    assert record.levelname == "ERROR" and "(iteration 3, device cpu:0)" in line  # ours follows
    assert "not reproducible within the tolerance" in line


def test_persistent_error_line_matches_megatrons_regex(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    save = tmp_path / "ckpt"
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    outcome = run_training(make_config(*_flags(save, "persistent_error")), DistributedContext())
    assert outcome.exit_code == 16 and not MEGATRON.search(caplog.text)  # not diagnosed yet
    caplog.clear()
    monkeypatch.setenv(DEVICE_ID_ENV, "7")  # relaunched on another device
    outcome = run_training(make_config(*_flags(save, "persistent_error")), DistributedContext())
    assert outcome.exit_code == 17, caplog.text[-3000:]
    matches = list(MEGATRON.finditer(caplog.text))
    assert [m.group(1) for m in matches] == ["persistent"], caplog.text[-3000:]
    assert "device 7: Possible persistent error!!" in matches[0].group(0)
