"""Checkpoints of an older layout resume exactly; a checkpoint missing a part or holding a
garbled one is refused in one line (resuming without it would silently restart that state)."""

from __future__ import annotations

import json

from stalwart.cli.main import main
from stalwart.train.resume_checks import upgrade_common_layout

from train_utils import TINY_FLAGS, assert_params_equal, load_params


def _train(save, *args: str) -> int:
    argv = ["train", *TINY_FLAGS, "--train-iters", "4", "--save", str(save), "--save-interval",
            "2", "--seed", "5", *args]  # fmt: skip
    return main(argv)


def _to_old_layout(common: dict) -> dict:
    """What stalwart wrote before the guarded step (e.g. at 20e0679), from today's dict."""
    old = {k: v for k, v in common.items() if k not in ("train_state", "data", "step")}
    old.update(common["train_state"])
    old["data"] = common["data"]["source"]
    old["loss_scaler"] = common["step"]["loss_scaler"]
    return old


def test_upgrade_maps_the_old_layout_and_keeps_todays() -> None:
    today = {"train_state": {"iteration": 4, "consumed_samples": 32}, "scheduler": {"lr": 1.0},
             "data": {"position": 2, "source": {"consumed_samples": 32, "micro_batch_size": 8,
                                                "dp_size": 2}}, "step": {"loss_scaler": {}}}  # fmt: skip
    assert upgrade_common_layout(dict(today)) == today
    assert upgrade_common_layout(_to_old_layout(today)) == today


def test_old_layout_resumes_bitwise(tmp_path) -> None:
    assert _train(tmp_path / "ref") == 0
    cut = tmp_path / "cut"
    assert _train(cut, "--exit-interval", "2") == 0
    common = cut / "iter_0000002" / "common.json"
    common.write_text(json.dumps(_to_old_layout(json.loads(common.read_text()))))
    assert _train(cut) == 0
    assert_params_equal(load_params(tmp_path / "ref"), load_params(cut))


def test_missing_or_garbled_part_is_one_line(tmp_path, capsys) -> None:
    save = tmp_path / "ckpt"
    assert _train(save, "--train-iters", "2") == 0
    common = save / "iter_0000002" / "common.json"
    state = json.loads(common.read_text())
    common.write_text(json.dumps({k: v for k, v in state.items() if k != "data"}))
    capsys.readouterr()
    assert _train(save) == 2
    err = capsys.readouterr().err
    assert "has no 'data' state" in err and "Traceback" not in err, err
    common.write_text(json.dumps({**state, "data": {"position": "north"}}))
    assert _train(save) == 2
    err = capsys.readouterr().err
    assert "its 'data' state is not what this loop saves" in err and "Traceback" not in err, err
