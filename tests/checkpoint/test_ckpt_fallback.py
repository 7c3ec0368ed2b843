"""``--ckpt-fallback`` past a damaged tracker, and damaged checkpoints named in one line with the
command that diagnoses them (issue 40 item 4), written as the attack: an empty, garbage, binary,
huge or unreadable ``latest_checkpointed_iteration.txt``; a shard whose non-tensor entry is not
a zip archive (``BadZipFile``), whose tensor bytes are zeros, or that is truncated."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointError, CheckpointManager, layout
from stalwart.cli.main import main

from train_utils import TINY_FLAGS

ITER_2 = layout.iteration_dir_name(2)
SCHEDULE = ["--lr-decay-iters", "6"]  # the same schedule for the run and its resume


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """Checkpoints 1 and 2, and the model/optimizer state of each."""
    root = tmp_path_factory.mktemp("fallback") / "save"
    model = make_model()
    opt = make_optimizer(model)
    manager = CheckpointManager(str(root))
    states = []
    for iteration in (1, 2):
        train_steps(model, opt, 2, seed=iteration)
        manager.save(iteration, model, opt, {"iteration": iteration}, {"r": iteration})
        states.append(snapshot(model, opt))
    manager.close()
    return root, states[0], states[1]


@pytest.fixture
def save(saved: tuple[Path, dict, dict], tmp_path: Path) -> Path:
    copy = tmp_path / "save"
    shutil.copytree(saved[0], copy)
    return copy


def _load(save: Path, fallback: bool) -> tuple[object, dict]:
    model = make_model(seed=9)
    opt = make_optimizer(model)
    train_steps(model, opt, 1)  # AdamW state to load into
    manager = CheckpointManager(None, str(save), fallback=fallback)
    try:
        loaded = manager.load(model, opt)
    finally:
        manager.close()
    return loaded, snapshot(model, opt)


def _hint(save: Path) -> str:
    return f"`stalwart checkpoints --verify {save}` names what is damaged"


def _damage_tracker(save: Path, kind: str) -> None:
    tracker = save / layout.TRACKER_FILENAME
    tracker.unlink()
    if kind == "directory":
        tracker.mkdir()
        return
    content = {
        "empty": b"",
        "garbage": b"garbage\n",
        "binary": b"\x00\xff\xfe\x01\x89PNG",
        "huge": os.urandom(1 << 20),
        "negative": b"-2\n",
        "release": b"release",
    }[kind]
    tracker.write_bytes(content)


TRACKERS = ["empty", "garbage", "binary", "huge", "negative", "release", "directory"]


@pytest.mark.parametrize("kind", TRACKERS)
def test_a_damaged_tracker_with_fallback_resumes_from_the_newest_complete_checkpoint(
    saved: tuple[Path, dict, dict], save: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    _damage_tracker(save, kind)
    manager = CheckpointManager(None, str(save), fallback=True)
    assert manager.latest_iteration() == 2  # the trainer's "is there one to resume" agrees
    manager.close()
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        loaded, state = _load(save, fallback=True)
    assert loaded is not None and loaded.iteration == 2  # type: ignore[attr-defined]
    assert_same(saved[2], state)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert f"checkpoint tracker {save / layout.TRACKER_FILENAME}" in said[0]
    assert said[0].endswith("falling back to the newest complete checkpoint (--ckpt-fallback)")
    assert "\n" not in said[0] and len(said[0]) < 400


@pytest.mark.parametrize("kind", TRACKERS)
def test_a_damaged_tracker_without_fallback_is_refused_naming_the_diagnosis(
    save: Path, kind: str
) -> None:
    _damage_tracker(save, kind)
    for attempt in (lambda m: m.latest_iteration(), lambda m: _load(save, fallback=False)):
        manager = CheckpointManager(None, str(save))
        with pytest.raises(CheckpointError) as info:
            attempt(manager)
        manager.close()
        message = str(info.value)
        assert f"checkpoint tracker {save / layout.TRACKER_FILENAME}" in message
        assert _hint(save) in message and "--ckpt-fallback" in message
        assert "\n" not in message and len(message) < 500, message


def _entry(ckpt: Path, fqn_part: str, tensor: bool) -> tuple[Path, int, int]:
    """(shard, offset, length) of the DCP entry whose name contains ``fqn_part``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = pickle.loads((ckpt / layout.DCP_METADATA_FILENAME).read_bytes())  # our own file
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or fqn_part not in index.fqn:
            continue
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata) == tensor:
            return ckpt / info.relative_path, info.offset, info.length
    raise AssertionError(f"no {'tensor' if tensor else 'bytes'} entry named *{fqn_part}*")


def _zero(shard: Path, offset: int, length: int) -> None:
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * length)


@pytest.mark.parametrize("damage", ["bytes_entry", "tensor_entry", "truncated"])
def test_a_damaged_checkpoint_is_one_line_naming_verify_and_fallback(
    saved: tuple[Path, dict, dict], save: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = save / ITER_2
    if damage == "truncated":
        shard = next(ckpt.glob("*.distcp"))
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        _zero(
            *_entry(
                ckpt,
                "param_groups" if damage == "bytes_entry" else "weight",
                tensor=damage == "tensor_entry",
            )
        )
    with pytest.raises(CheckpointError) as info:
        _load(save, fallback=False)
    message = str(info.value)
    assert str(ckpt) in message and _hint(save) in message and "--ckpt-fallback" in message
    assert "\n" not in message and len(message) < 600, message
    if damage == "bytes_entry":
        assert "BadZipFile: File is not a zip file" in message  # the cause, then what to run
    assert "weights_only" not in message  # never torch's advice to load with weights_only=False
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        loaded, state = _load(save, fallback=True)
    assert loaded is not None and loaded.iteration == 1  # type: ignore[attr-defined]
    assert_same(saved[1], state)
    assert "--ckpt-fallback" in caplog.text
    assert main(["checkpoints", str(save), "--verify"]) == 1  # the diagnosis the line names


def test_an_explicit_iteration_names_verify_but_not_fallback(save: Path) -> None:
    _zero(*_entry(save / ITER_2, "param_groups", tensor=False))
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    manager = CheckpointManager(None, str(save), fallback=True)
    with pytest.raises(CheckpointError) as info:
        manager.load(model, opt, iteration=2)
    manager.close()
    assert _hint(save) in str(info.value) and "--ckpt-fallback" not in str(info.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("trained") / "ckpt"
    argv = [
        "train",
        *TINY_FLAGS,
        *SCHEDULE,
        "--train-iters",
        "4",
        "--save-interval",
        "2",
        "--save",
        str(save),
    ]
    assert main(argv) == 0
    return save


@pytest.mark.parametrize("fallback", [False, True])
def test_stalwart_train_on_a_garbage_tracker(
    trained: Path,
    tmp_path: Path,
    fallback: bool,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    save = tmp_path / "ckpt"
    shutil.copytree(trained, save)
    (save / layout.TRACKER_FILENAME).write_bytes(b"\x00garbage\xff")
    capsys.readouterr()
    argv = ["train", *TINY_FLAGS, *SCHEDULE, "--train-iters", "6", "--save", str(save)]
    with caplog.at_level(logging.INFO, logger="stalwart.checkpoint"):  # in-process: log records
        code = main([*argv, *(["--ckpt-fallback"] if fallback else [])])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if not fallback:
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stalwart train: checkpoint error: "), err
        assert _hint(save) in lines[0] and "--ckpt-fallback" in lines[0]
        return
    assert code == 0, err[-3000:]
    assert layout.read_tracker(str(save)) == 6  # resumed at 4, trained on, tracked again
    assert "falling back to the newest complete checkpoint (--ckpt-fallback)" in caplog.text
    loaded = f"loaded checkpoint iteration 4 from {save / layout.iteration_dir_name(4)}"
    assert loaded in caplog.text


def test_torch_s_weights_only_advice_becomes_the_reason() -> None:
    from stalwart.checkpoint.dcp_io import _first_line

    torch_said = pickle.UnpicklingError(
        "Weights only load failed. In PyTorch 2.6, we changed the default value of the "
        "`weights_only` argument in `torch.load` from `False` to `True`. Re-running `torch.load` "
        "with `weights_only` set to `False` will likely succeed, but it can result in arbitrary "
        "code execution. Do it only if you got the file from a trusted source.\nPlease file an "
        "issue with the following so that we can make `weights_only=True` compatible with your "
        "use case: WeightsUnpickler error: \n\nUnsupported operand 0\n\nCheck the documentation "
        "of torch.load to learn more about types accepted by default with weights_only "
        "https://pytorch.org/docs/stable/generated/torch.load.html."
    )
    assert _first_line(torch_said) == (
        "UnpicklingError: not a tensor torch reads safely (damaged or foreign data): "
        "Unsupported operand 0"
    )
    assert _first_line(ValueError("plain\nsecond")) == "ValueError: plain"
