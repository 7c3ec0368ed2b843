"""Resuming with other model flags: one line naming each flag before any tensor is read."""

from __future__ import annotations

import pytest

from stalwart.cli.main import main
from stalwart.train.resume_checks import check_model_matches, model_config_differences

from train_utils import TINY_FLAGS


def test_differences_split_into_shape_refusals_and_notes() -> None:
    saved = {"hidden_size": 64, "dropout": 0.0, "num_layers": 2, "only_old": 1}
    current = {"hidden_size": 128, "dropout": 0.1, "num_layers": 2, "only_new": 2}
    refusals, notes = model_config_differences(saved, current)
    assert refusals == ["--hidden-size: checkpoint 64, this run 128"]
    assert notes == ["--hidden-dropout: checkpoint 0.0, this run 0.1"]
    logged: list[str] = []
    check_model_matches({"config": {"model": {"dropout": 0.0}}}, {"dropout": 0.1}, logged.append)
    assert logged == [
        "resuming with changed model settings: --hidden-dropout: checkpoint 0.0, this run 0.1"
    ]
    check_model_matches({}, current)  # no recorded config: nothing to compare
    with pytest.raises(ValueError, match="--hidden-size: checkpoint 64, this run 128"):
        check_model_matches({"config": {"model": saved}}, current)


def test_cli_refuses_another_shape_with_one_line_and_keeps_the_checkpoint(tmp_path, capsys) -> None:
    save = str(tmp_path / "ckpt")
    assert main(["train", *TINY_FLAGS, "--train-iters", "2", "--save", save]) == 0
    tracker = (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()
    capsys.readouterr()
    code = main(["train", *TINY_FLAGS, "--train-iters", "4", "--save", save, "--num-layers", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("stalwart train: error: the checkpoint was saved with another model")
    assert "--num-layers: checkpoint 1, this run 2" in err[-1]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == tracker


def test_a_resume_builds_the_model_blank_and_a_fresh_run_initialises_it(
    tmp_path, monkeypatch
) -> None:
    from stalwart.models import GPT

    blank_builds: list[int] = []
    for_loading = GPT.for_loading.__func__  # type: ignore[attr-defined]

    def spy(cls, config, device):
        blank_builds.append(1)
        return for_loading(cls, config, device)

    monkeypatch.setattr(GPT, "for_loading", classmethod(spy))
    save = str(tmp_path / "ckpt")
    assert main(["train", *TINY_FLAGS, "--train-iters", "2", "--save", save]) == 0
    assert blank_builds == []  # nothing to load: the random initialisation
    assert main(["train", *TINY_FLAGS, "--train-iters", "4", "--save", save,
                 "--override-opt-param-scheduler"]) == 0  # fmt: skip
    assert blank_builds == [1]


def test_a_checkpoint_gone_between_build_and_load_stops_the_blank_model(
    tmp_path, monkeypatch, capsys
) -> None:
    from stalwart.loop.checkpointing import Checkpointer

    save = str(tmp_path / "ckpt")
    assert main(["train", *TINY_FLAGS, "--train-iters", "2", "--save", save]) == 0
    capsys.readouterr()
    monkeypatch.setattr(Checkpointer, "load", lambda self, **kwargs: None)
    assert main(["train", *TINY_FLAGS, "--train-iters", "4", "--save", save]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"stalwart train: checkpoint error: --load {save}: its checkpoint went away at start"
    )
