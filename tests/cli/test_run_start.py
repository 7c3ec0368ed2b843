"""The first line of a run: its run directory, and every default it relies on that differs from
Megatron's (issue 30 item 12: defaults never differ without a word)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.cli.run_start import default_run_dir, megatron_default_differences, start_line
from stalwart.config.run import build_run_config, explicit_flags

from train_utils import TINY_FLAGS


def _line(*flags: str) -> str:
    argv = [*TINY_FLAGS, *flags]
    ns = parse_train_args(argv)
    config = build_run_config(ns, argv)
    return start_line(config, explicit_flags(ns, argv))


def test_the_defaults_unlike_megatrons_are_named_with_megatrons_value() -> None:
    line = _line()
    for text in (
        "--weight-decay 0.1 (Megatron: 0.01)",
        "--adam-beta2 0.95 (Megatron: 0.999)",
        "--lr-decay-style cosine (Megatron: linear)",
        "--hidden-dropout 0.0 (Megatron: 0.1)",
    ):
        assert text in line, line
    assert "--log-interval" not in line  # TINY_FLAGS sets it: not a default this run relies on
    assert "--moe-aux-loss-coeff" not in line and "--initial-loss-scale" not in line  # dense, fp32


def test_a_flag_given_either_way_is_not_listed() -> None:
    line = _line("--weight-decay", "0.1", "--adam-beta2", "0.999", "--lr-decay-style", "linear",
                 "--hidden-dropout", "0", "--eval-interval", "0", "--num-workers", "0")  # fmt: skip
    assert "Megatron" not in line, line


def test_moe_and_fp16_defaults_are_listed_where_they_apply() -> None:
    line = _line("--num-experts", "2", "--fp16")
    assert "--moe-aux-loss-coeff 0.01 (Megatron: 0.0)" in line
    assert "--moe-expert-capacity-factor 1.25 (Megatron: none)" in line
    assert "--initial-loss-scale 65536 (Megatron: 4294967296)" in line


def test_config_file_keys_count_as_given(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("weight_decay = 0.1\n")
    argv = [*TINY_FLAGS, "--config", str(toml)]
    ns = parse_train_args(argv)
    differences = megatron_default_differences(build_run_config(ns, argv), explicit_flags(ns, argv))
    assert not any(d.startswith("--weight-decay") for d in differences)


def test_default_run_dir_names() -> None:
    now = datetime.datetime(2026, 12, 4, 18, 30, 5)
    assert default_run_dir({}, now, exists=lambda p: False) == "runs/20261204-183005"
    taken = {"runs/20261204-183005"}
    assert default_run_dir({}, now, exists=taken.__contains__) == "runs/20261204-183005-2"
    assert default_run_dir({"STALWART_RUNS_DIR": "/r"}, now, exists=lambda p: False).startswith(
        "/r/"
    )
    torchrun = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}
    assert default_run_dir(torchrun, now) == "runs/torchrun-abc"  # the same on every rank
    assert default_run_dir({"WORLD_SIZE": "2"}, now) is None  # ranks could not agree on a name


def test_print_config_writes_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STALWART_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["train", *TINY_FLAGS, "--print-config"]) == 0
    assert not (tmp_path / "runs").exists()


def test_a_file_as_runs_dir_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("STALWART_RUNS_DIR", str(tmp_path / "f"))
    assert main(["train", *TINY_FLAGS, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "STALWART_RUNS_DIR" in err, err
