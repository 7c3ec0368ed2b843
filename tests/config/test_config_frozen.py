"""Issue 14: a built run config is never changed afterwards (cross-component values are derived
before it is built, the combination checks only check), and the modes (``--timing-mode``,
``--timing-log-option``, ``--wandb-mode``) are enums from the CLI/TOML boundary to the components,
which refuse a plain string."""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.config.run import build_run_config, check_combinations, derive_combinations
from stalwart.config.training import TrainingConfig
from stalwart.observability.sinks import SinkConfig, WandbMode, WandbSink, build_sinks
from stalwart.observability.timers import TimerConfig, Timers, TimingLogOption, TimingMode
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.rerun import RerunConfig

from train_utils import TINY_FLAGS, make_config


def test_derived_values_are_set_when_built_and_the_config_is_frozen() -> None:
    config = make_config("--fp16")
    # fp16 turns the NaN check off; the default progress bar means "only on a TTY" (None).
    assert config.shell.rerun.check_for_nan_in_loss_and_grad is False
    assert make_config().shell.rerun.check_for_nan_in_loss_and_grad is True
    assert config.shell.log.log_progress_bar is False  # TINY_FLAGS has --no-progress-bar
    argv = [f for f in TINY_FLAGS if f != "--no-progress-bar"]
    assert build_run_config(parse_train_args(argv), argv).shell.log.log_progress_bar is None
    for target, name, value in ((config.shell, "timers", None), (config.shell.timers, "timing_mode", "events"),
                                (config.graphs, "cuda_graph_impl", "none")):  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, value)
    changed = dataclasses.replace(config, preset="small")  # a changed copy, the original kept
    assert (changed.preset, config.preset) == ("small", "tiny")


def test_derive_combinations_is_pure_and_check_combinations_changes_nothing() -> None:
    log, rerun, fp16 = LogConfig(log_progress_bar=True), RerunConfig(), TrainingConfig(fp16=True)
    new_log, new_rerun = derive_combinations(fp16, log, rerun)
    assert (new_log.log_progress_bar, new_rerun.check_for_nan_in_loss_and_grad) == (None, False)
    assert (log.log_progress_bar, rerun.check_for_nan_in_loss_and_grad) == (True, True)
    assert derive_combinations(TrainingConfig(), log, rerun)[1] is rerun  # nothing to derive

    # A config built without the derivation keeps its values through the checks.
    built = make_config()
    shell = dataclasses.replace(
        built.shell, log=log, rerun=RerunConfig(check_for_nan_in_loss_and_grad=True)
    )
    config = dataclasses.replace(built, training=fp16, shell=shell)
    before = config.to_dict()
    check_combinations(config)
    assert config.to_dict() == before
    assert (
        config.shell.rerun.check_for_nan_in_loss_and_grad is True
        and config.shell.log.log_progress_bar
    )


MODE_FLAGS = {
    "--timing-mode": "sync, events",
    "--timing-log-option": "max, minmax, all",
    "--wandb-mode": "online, offline, disabled",
}


@pytest.mark.parametrize("flag", MODE_FLAGS)
@pytest.mark.parametrize("how", ["flag", "toml"])
def test_a_bad_mode_exits_2_naming_the_flag(how: str, flag: str, tmp_path, capsys) -> None:
    if how == "flag":
        extra = [flag, "bogus"]
    else:
        toml = tmp_path / "run.toml"
        toml.write_text(f'{flag[2:].replace("-", "_")} = "bogus"\n')
        extra = ["--config", str(toml)]
    assert main(["train", *TINY_FLAGS, *extra, "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "bogus" in err, err
    assert all(value in err for value in MODE_FLAGS[flag].split(", ")), err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_the_config_parses_each_mode_once_naming_the_flag() -> None:
    timers, sinks = TimerConfig(timing_log_option="all"), SinkConfig(wandb_mode="offline")
    assert timers.timing_log_option is TimingLogOption.ALL and sinks.wandb_mode is WandbMode.OFFLINE
    assert SinkConfig().wandb_mode is None
    assert TimerConfig().timing_log_option is TimingLogOption.MINMAX
    for kind, field, flag in (
        (TimerConfig, "timing_log_option", "--timing-log-option"),
        (SinkConfig, "wandb_mode", "--wandb-mode"),
    ):
        allowed = MODE_FLAGS[flag]
        with pytest.raises(ValueError, match=f"^{flag}: got 'bogus', allowed: {allowed}$"):
            kind(**{field: "bogus"})


def test_log_option_and_wandb_mode_are_enums_from_the_flag_to_the_components() -> None:
    config = make_config("--timing-log-option", "all", "--wandb-mode", "disabled")
    assert config.shell.timers.timing_log_option is TimingLogOption.ALL
    assert config.shell.sinks.wandb_mode is WandbMode.DISABLED
    assert config.to_dict()["timers"]["timing_log_option"] == "all"  # the flag's value
    assert config.to_dict()["sinks"]["wandb_mode"] == "disabled"
    shell = config.shell.build()
    shell.close()
    timers = shell.timers
    assert timers.log_option is TimingLogOption.ALL
    # A string would print min/max for a typo, or reach wandb unchecked: the components refuse it.
    with pytest.raises(TypeError, match="TimingLogOption"):
        Timers(0, "all")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WandbMode"):
        build_sinks(rank=0, wandb_project="p", wandb_mode="disabled")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WandbMode"):
        WandbSink("p", mode="disabled")  # type: ignore[arg-type]


def test_timing_mode_is_an_enum_from_the_flag_to_the_timers() -> None:
    config = make_config("--timing-mode", "events", "--timing-log-level", "1")
    assert config.shell.timers.timing_mode is TimingMode.EVENTS
    assert make_config().shell.timers.timing_mode is TimingMode.SYNC
    assert TimerConfig(timing_mode="events").timing_mode is TimingMode.EVENTS
    with pytest.raises(ValueError, match="--timing-mode: got 'bogus', allowed: sync, events"):
        TimerConfig(timing_mode="bogus")
    shell = config.shell.build()
    shell.close()
    timers = shell.timers
    assert timers.mode is TimingMode.EVENTS and timers.log_level == 1
    # A string would silently time on the host clock: the component refuses it.
    with pytest.raises(TypeError, match="TimingMode"):
        Timers(0, TimingLogOption.MAX, mode="events")  # type: ignore[arg-type]
