"""``stalwart checkpoints`` (list, verify) and ``stalwart export`` (one weights file)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT, GPTConfig
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config


@pytest.fixture(scope="module")
def save(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts") / "save"
    config = make_config("--train-iters", "6", "--save", str(root), "--save-interval", "3")
    run_training(config, DistributedContext())
    return root


def test_list_and_verify(save, capsys) -> None:
    assert main(["checkpoints", str(save), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{save}: tracker names 6" in out
    assert "iter_0000003  complete, verified  saved by 1 rank(s)" in out
    assert "iter_0000006  complete, verified  saved by 1 rank(s)" in out
    assert out.count("<- tracker") == 1 and out.index("<- tracker") > out.index("iter_0000006")
    assert "last exit: finished at iteration 6 (exit code 0): reached --train-iters" in out


def test_a_truncated_shard_of_the_tracked_checkpoint_exits_1(save, tmp_path, capsys) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(save, broken)
    shard = next((broken / "iter_0000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    (broken / "iter_0000009.tmp-abc").mkdir()  # a crashed save
    assert main(["checkpoints", str(broken), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "iter_0000006  complete, BROKEN: shard" in out and "truncated" in out
    assert "iter_0000003  complete, verified" in out
    assert "leftover partial save: " in out and "iter_0000009.tmp-abc" in out
    assert main(["checkpoints", str(broken)]) == 0  # listing alone does not read shards


def _load_export(path: Path) -> tuple[dict, GPT]:
    payload = torch.load(path, weights_only=True)
    model = GPT(GPTConfig(**payload["model_config"]))
    return payload, model


def test_export_round_trip(save, tmp_path, capsys) -> None:
    out = tmp_path / "weights.pt"
    assert main(["export", "--load", str(save), "--out", str(out)]) == 0
    assert "exported iteration 6" in capsys.readouterr().out
    payload, model = _load_export(out)
    assert payload["iteration"] == 6 and payload["source"].endswith("iter_0000006")
    model.load_state_dict(payload["model"])
    assert_params_equal(model.state_dict(), load_params(save))

    older = tmp_path / "older.pt"
    args = [
        "export",
        "--load",
        str(save),
        "--iteration",
        "3",
        "--out",
        str(older),
        "--dtype",
        "bf16",
    ]
    assert main(args) == 0
    payload, _ = _load_export(older)
    assert payload["iteration"] == 3
    assert all(v.dtype == torch.bfloat16 for v in payload["model"].values())
    expected = {k: v.to(torch.bfloat16) for k, v in load_params(save, 3).items()}
    assert_params_equal(payload["model"], expected)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--iteration", "4"], "is not loadable: directory is missing"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_export_errors_exit_2_with_one_line(save, tmp_path, capsys, args, needle) -> None:
    out = tmp_path / "x.pt"
    assert main(["export", "--load", str(save), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err
    assert not out.exists()


def test_missing_directory(tmp_path, capsys) -> None:
    assert main(["checkpoints", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", "--load", str(tmp_path), "--out", str(tmp_path / "w.pt")]) == 2
    assert "pass --iteration" in capsys.readouterr().err


def _flip_shard(save: Path, tmp_path: Path) -> Path:
    import shutil

    broken = tmp_path / "flipped"
    shutil.copytree(save, broken)
    shard = next((broken / "iter_0000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return broken


def test_verify_checkpoint_on_load_refuses_or_falls_back(save, tmp_path, capsys, caplog) -> None:
    """--verify-checkpoint-on-load (issue 29, item 10): a flipped byte in the newest checkpoint
    is one line and exit 2; with --ckpt-fallback the run resumes from the previous one."""
    from train_utils import TINY_FLAGS

    broken = _flip_shard(save, tmp_path)
    assert main(["checkpoints", str(broken), "--verify"]) == 1
    capsys.readouterr()
    run = ["train", *TINY_FLAGS, "--train-iters", "6", "--save", str(broken)]
    assert main([*run, "--verify-checkpoint-on-load"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "does not match its checksum" in err[-1] and "iter_0000006" in err[-1], err
    with caplog.at_level(logging.INFO, logger="stalwart.checkpoint"):
        assert main([*run, "--verify-checkpoint-on-load", "--ckpt-fallback"]) == 0
    assert "does not match its checksum" in caplog.text
    assert "loaded checkpoint iteration 3" in caplog.text
    assert_params_equal(load_params(broken, 6), load_params(save, 6))  # iterations 4-6 again
