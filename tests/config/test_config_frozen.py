"""Issue 14: a built run config is never changed afterwards (cross-component values are derived
before it is built, the combination checks only check), and ``--timing-mode`` is a `TimingMode`
from the CLI/TOML boundary to the timers."""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.config.observability import ObservabilityConfig
from stalwart.config.run import build_run_config, check_combinations, derive_combinations
from stalwart.config.training import TrainingConfig
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT
from stalwart.observability.timers import Timers, TimingMode
from stalwart.observability.train_log import LogConfig
from stalwart.reliability.rerun import RerunConfig

from train_utils import TINY_FLAGS, make_config


def test_derived_values_are_set_when_built_and_the_config_is_frozen() -> None:
    config = make_config("--fp16")
    # fp16 turns the NaN check off; the default progress bar means "only on a TTY" (None).
    assert config.rerun.check_for_nan_in_loss_and_grad is False
    assert make_config().rerun.check_for_nan_in_loss_and_grad is True
    assert config.log.log_progress_bar is False  # TINY_FLAGS has --no-progress-bar
    argv = [f for f in TINY_FLAGS if f != "--no-progress-bar"]
    assert build_run_config(parse_train_args(argv), argv).log.log_progress_bar is None
    for target, name, value in ((config, "obs", None), (config.obs, "timing_mode", "events"),
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
    config = dataclasses.replace(
        make_config(),
        training=fp16,
        log=log,
        rerun=RerunConfig(check_for_nan_in_loss_and_grad=True),
    )
    before = config.to_dict()
    check_combinations(config)
    assert config.to_dict() == before
    assert config.rerun.check_for_nan_in_loss_and_grad is True and config.log.log_progress_bar


@pytest.mark.parametrize("how", ["flag", "toml"])
def test_a_bad_timing_mode_exits_2_naming_the_flag(how: str, tmp_path, capsys) -> None:
    if how == "flag":
        extra = ["--timing-mode", "bogus"]
    else:
        toml = tmp_path / "run.toml"
        toml.write_text('timing_mode = "bogus"\n')
        extra = ["--config", str(toml)]
    assert main(["train", *TINY_FLAGS, *extra, "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--timing-mode" in err and "bogus" in err, err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_timing_mode_is_an_enum_from_the_flag_to_the_timers() -> None:
    from stalwart.train.observe import build_observability

    config = make_config("--timing-mode", "events", "--timing-log-level", "1")
    assert config.obs.timing_mode is TimingMode.EVENTS
    assert make_config().obs.timing_mode is TimingMode.SYNC
    assert ObservabilityConfig(timing_mode="events").timing_mode is TimingMode.EVENTS
    with pytest.raises(ValueError, match="--timing-mode: got 'bogus', allowed: sync, events"):
        ObservabilityConfig(timing_mode="bogus")
    timers, sink, *_ = build_observability(
        config, DistributedContext(), 0.0, GPT(config.model), None
    )
    sink.close()
    assert timers.mode is TimingMode.EVENTS and timers.log_level == 1
    # A string would silently time on the host clock: the component refuses it.
    with pytest.raises(TypeError, match="TimingMode"):
        Timers(0, "max", mode="events")  # type: ignore[arg-type]
