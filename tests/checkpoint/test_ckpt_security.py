"""Nothing read from a checkpoint or run directory executes code.

Every file the loaders read gets a real payload: a pickle whose ``__reduce__`` runs ``exec`` to
write a marker file (what a hostile ``common.pt``, ``.metadata`` or shard entry does on a plain
``pickle.load``/``torch.load(weights_only=False)``). Then ``stalwart train`` (resume),
``stalwart checkpoints --verify``, ``stalwart export`` and ``stalwart report`` run on the
directory: the marker must never appear, and each command answers without a traceback.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointError, layout
from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.train.trainer import run_training

from hostile import hostile_pickle, hostile_torch_save
from train_utils import TINY_FLAGS, make_config

TRAIN = ["--train-iters", "4", "--save-interval", "2", "--seed", "5"]
LAST = "iter_0000004"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("clean") / "save"
    run_training(make_config(*TRAIN, "--save", str(save)), DistributedContext())
    return save


def _repoint_item(ckpt: Path, fqn: str, blob: bytes) -> None:
    """Append ``blob`` to a shard and point the DCP metadata entry of ``fqn`` at it (the test
    writes the metadata with plain pickle: it is the attacker here)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own clean file
    index = next(i for i in metadata.storage_data if isinstance(i, MetadataIndex) and i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    info.offset, info.length = offset, len(blob)
    (ckpt / layout.DCP_METADATA_FILENAME).write_bytes(pickle.dumps(metadata))


def _plant(save: Path, where: str, marker: Path) -> None:
    ckpt = save / LAST
    payload = hostile_pickle(marker)
    if where == "metadata":
        (ckpt / layout.DCP_METADATA_FILENAME).write_bytes(payload)
    elif where == "common":
        (ckpt / layout.COMMON_FILENAME).write_bytes(payload)
    elif where == "rank":
        (ckpt / layout.rank_filename(0)).write_bytes(payload)
    elif where == "legacy_pickles":  # the format of stalwart before JSON state (main 20e0679)
        for name in ("common.json", "rank_00000.json"):
            (ckpt / name).unlink(missing_ok=True)
        (ckpt / "common.pt").write_bytes(payload)
        (ckpt / "rank_00000.pt").write_bytes(payload)
    elif where == "bytes_item":  # a non-tensor DCP entry (optimizer hyperparameter)
        _repoint_item(ckpt, "optim.param_groups.0.lr", hostile_torch_save(marker))
    elif where == "tensor_item":  # a tensor DCP entry (read by torch's weights_only loader)
        _repoint_item(ckpt, "model.final_layernorm.weight", hostile_torch_save(marker))
    elif where == "side_files":  # every other file a command reads
        for name in (layout.TRACKER_FILENAME, "exit_reason.json", "metrics.jsonl", "events.jsonl",
                     "memory.json", "rerun_verdict.json", ".stalwart.lock"):  # fmt: skip
            (save / name).write_bytes(payload)
        for name in (layout.METADATA_FILENAME, layout.COMPLETE_MARKER):
            (ckpt / name).write_bytes(payload)
    else:
        raise AssertionError(where)


PLACES = ["metadata", "common", "rank", "legacy_pickles", "bytes_item", "tensor_item", "side_files"]


@pytest.mark.parametrize("where", PLACES)
def test_planted_payloads_never_run(
    where: str, clean_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save, marker = tmp_path / "save", tmp_path / "PWNED"
    shutil.copytree(clean_run, save)
    _plant(save, where, marker)
    capsys.readouterr()

    resume = main(["train", *TINY_FLAGS, *TRAIN, "--train-iters", "6", "--save", str(save)])
    err = capsys.readouterr().err
    assert not marker.exists(), f"train ran the payload planted in {where}"
    if where != "side_files":  # a garbage tracker is refused as well; that is checked below
        assert resume == 2 and "checkpoint error" in err, err[-2000:]
    assert "Traceback" not in err

    verify = main(["checkpoints", str(save), "--verify"])
    out = capsys.readouterr()
    assert not marker.exists(), f"checkpoints --verify ran the payload planted in {where}"
    assert verify in (0, 1) and "Traceback" not in out.err

    export = main(
        ["export", "--load", str(save), "--iteration", "4", "--out", str(tmp_path / "w.pt")]
    )
    out = capsys.readouterr()
    assert not marker.exists(), f"export ran the payload planted in {where}"
    assert "Traceback" not in out.err
    if where in ("metadata", "common", "legacy_pickles", "tensor_item"):  # export reads no optim
        assert export == 2 and out.err.startswith("stalwart export: error: "), out.err

    report = main(["report", str(save), "--no-png"])
    out = capsys.readouterr()
    assert not marker.exists(), f"report ran the payload planted in {where}"
    assert report == 0 and "Traceback" not in out.err


def test_side_file_payloads_give_one_line_each(clean_run: Path, tmp_path: Path, capsys) -> None:
    save, marker = tmp_path / "save", tmp_path / "PWNED"
    shutil.copytree(clean_run, save)
    _plant(save, "side_files", marker)
    capsys.readouterr()
    assert main(["train", *TINY_FLAGS, *TRAIN, "--save", str(save)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and layout.TRACKER_FILENAME in err[0], err
    assert main(["checkpoints", str(save)]) == 1  # the resume above refuses it: not 0
    out = capsys.readouterr().out
    assert "BROKEN tracker" in out and "last exit: unknown" in out
    assert not marker.exists()


def test_legacy_checkpoint_is_refused_with_the_convert_command(clean_run, tmp_path, capsys) -> None:
    save = tmp_path / "save"
    shutil.copytree(clean_run, save)
    _plant(save, "legacy_pickles", tmp_path / "PWNED")
    capsys.readouterr()
    assert main(["train", *TINY_FLAGS, *TRAIN, "--train-iters", "6", "--save", str(save)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"stalwart checkpoints convert --trust-pickle {save / LAST}" in err[0]


def test_restricted_unpickler_allows_real_metadata_and_entries_only(clean_run, tmp_path) -> None:
    from stalwart.checkpoint.dcp_safe import load_bytes_item, read_dcp_metadata

    metadata = read_dcp_metadata(clean_run / LAST)
    assert "model.final_layernorm.weight" in metadata.state_dict_metadata
    buf = io.BytesIO()
    torch.save((0.9, 0.95), buf)
    buf.seek(0)
    assert load_bytes_item(buf) == (0.9, 0.95)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(hostile_pickle(tmp_path / "PWNED"))
    with pytest.raises(CheckpointError, match=r"builtins\.exec is not allowed"):
        read_dcp_metadata(evil)
    with pytest.raises(CheckpointError, match="not allowed"):
        load_bytes_item(io.BytesIO(hostile_torch_save(tmp_path / "PWNED")))
    assert not (tmp_path / "PWNED").exists()
