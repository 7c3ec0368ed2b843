"""The first lines of a run (at most two, short): its run directory, and how many defaults
that differ from Megatron's it relies on, with the list in run.json and the table in --help
(issue 30 item 12: defaults never differ without a word; issue 44 item 2: a quiet start)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.cli.run_start import default_run_dir, megatron_default_differences, start_lines
from stalwart.config.megatron_defaults import MEGATRON_DEFAULTS
from stalwart.config.run import RunConfig, build_run_config, explicit_flags

from train_utils import TINY_FLAGS


def _config(*flags: str) -> RunConfig:
    argv = [*TINY_FLAGS, *flags]
    return build_run_config(parse_train_args(argv), argv)


def test_the_defaults_unlike_megatrons_are_named_with_megatrons_value() -> None:
    relied_on = _config().megatron_defaults
    for text in (
        "--weight-decay 0.1 (Megatron: 0.01)",
        "--adam-beta2 0.95 (Megatron: 0.999)",
        "--lr-decay-style cosine (Megatron: linear)",
        "--hidden-dropout 0.0 (Megatron: 0.1)",
    ):
        assert text in relied_on, relied_on
    assert not any(d.startswith("--log-interval") for d in relied_on)  # TINY_FLAGS sets it
    assert not any("--moe-" in d or "--initial-loss-scale" in d for d in relied_on)  # dense, fp32


def test_the_start_is_two_short_lines_that_count_them() -> None:
    config = _config("--save", "runs/demo")
    lines = start_lines(config).splitlines()
    n = len(config.megatron_defaults)
    assert lines == [
        "stalwart train: run directory runs/demo (then: stalwart report runs/demo)",
        f"  {n} defaults unlike Megatron's: --weight-decay 0.1, +{n - 1} more "
        "(run.json and --help list them)",  # as many named as fit in 100 characters
    ]
    assert all(len(line) <= 100 for line in lines)
    alone = start_lines(_config()).splitlines()  # no run directory: --help has the table
    assert alone[0].startswith("stalwart train: no run directory (")
    assert alone[1].endswith("more (--help lists them)")


def test_a_flag_given_either_way_is_not_listed() -> None:
    config = _config(
        "--weight-decay",
        "0.1",
        "--adam-beta2",
        "0.999",
        "--lr-decay-style",
        "linear",
        "--hidden-dropout",
        "0",
        "--eval-interval",
        "0",
        "--num-workers",
        "0",
    )
    assert config.megatron_defaults == ()
    assert start_lines(config) == (
        "stalwart train: no run directory (--save or --run-dir keeps metrics and goodput)"
    )


def test_moe_and_fp16_defaults_are_listed_where_they_apply() -> None:
    relied_on = _config("--num-experts", "2", "--fp16").megatron_defaults
    assert "--moe-aux-loss-coeff 0.01 (Megatron: 0.0)" in relied_on
    assert "--moe-expert-capacity-factor 1.25 (Megatron: none)" in relied_on
    assert "--initial-loss-scale 65536 (Megatron: 4294967296)" in relied_on


def test_config_file_keys_count_as_given(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("weight_decay = 0.1\n")
    argv = [*TINY_FLAGS, "--config", str(toml)]
    ns = parse_train_args(argv)
    differences = megatron_default_differences(build_run_config(ns, argv), explicit_flags(ns, argv))
    assert not any(d.startswith("--weight-decay") for d in differences)
    assert not any(
        d.startswith("--weight-decay") for d in build_run_config(ns, argv).megatron_defaults
    )


def test_the_list_is_in_run_json_and_the_table_in_help(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "run"
    assert main(["train", *TINY_FLAGS, "--train-iters", "1", "--save", str(save)]) == 0
    out = capsys.readouterr().out.splitlines()
    config = json.loads((save / "run.json").read_text())["config"]
    assert config["megatron_defaults"] == list(_config().megatron_defaults)
    assert out[1].startswith(f"  {len(config['megatron_defaults'])} defaults unlike Megatron's:")
    assert main(["train", "--help"]) == 0
    page = " ".join(capsys.readouterr().out.split())
    assert "Defaults unlike Megatron-LM's" in page
    for d in MEGATRON_DEFAULTS:
        assert f"{d.flag} " in page, d.flag
    # Where the settings came from is not a setting: the same flags are the same run.
    assert _config().to_dict() == _config("--weight-decay", "0.1").to_dict()


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
