"""Checkpoint hardening at the manager level: permissions, overlapping directories, retention
that deletes only its own kind, saves before the first optimizer step, bad trackers, bad
``--load``, failed async saves, the commit hook, JSON state and the legacy-format conversion."""

from __future__ import annotations

import errno
import os
import random
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_fixtures import make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointError, CheckpointManager, layout


def _save(mgr: CheckpointManager, it: int, model: Any, opt: Any, **kw: Any) -> None:
    mgr.save(it, model, opt, {"iteration": it}, {"rng": torch.get_rng_state()}, **kw)


def _trained() -> tuple[Any, Any]:
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    return model, opt


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_side_files_respect_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        model, opt = _trained()
        mgr = CheckpointManager(str(tmp_path))
        _save(mgr, 1, model, opt)
        mgr.close()
    finally:
        os.umask(old)
    ckpt = tmp_path / "iter_0000001"
    files = [tmp_path / layout.TRACKER_FILENAME, ckpt / layout.COMPLETE_MARKER,
             ckpt / layout.METADATA_FILENAME, ckpt / layout.COMMON_FILENAME,
             ckpt / layout.rank_filename(0)]  # fmt: skip
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    assert stat.S_IMODE((ckpt / ".metadata").stat().st_mode) == 0o666 & ~umask  # DCP's own


@pytest.mark.parametrize("where", ["same", "inside", "holds"])
def test_overlapping_non_persistent_dir_is_refused(tmp_path: Path, where: str) -> None:
    save = tmp_path / "save"
    np_dir = {"same": save, "inside": save / "np", "holds": tmp_path}[where]
    with pytest.raises(ValueError, match=r"--non-persistent-ckpt-dir .* --save") as info:
        CheckpointManager(str(save), non_persistent_dir=str(np_dir))
    assert "\n" not in str(info.value)
    CheckpointManager(str(save), non_persistent_dir=str(save / "non_persistent"))  # the default


def test_overlapping_dirs_exit_2_from_the_cli(tmp_path: Path, capsys) -> None:
    from stalwart.cli.main import main

    from train_utils import TINY_FLAGS

    save = tmp_path / "save"
    code = main(["train", *TINY_FLAGS, "--train-iters", "2", "--save", str(save),
                 "--non-persistent-ckpt-dir", str(save)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--non-persistent-ckpt-dir" in err[0], err


def test_retention_deletes_only_its_own_kind(tmp_path: Path) -> None:
    """A directory used as non-persistent root that holds persistent checkpoints (of an
    earlier job) keeps them: non-persistent retention removes only non-persistent saves."""
    model, opt = _trained()
    shared = tmp_path / "shared"
    persistent = CheckpointManager(str(shared))
    for it in (1, 2):
        _save(persistent, it, model, opt)
    persistent.close()
    job = CheckpointManager(str(tmp_path / "save"), non_persistent_dir=str(shared))
    for it in (3, 4, 5):
        _save(job, it, model, opt, non_persistent=True)
    job.close()
    assert layout.list_complete_checkpoints(str(shared)) == [1, 2, 5]
    assert layout.written_as(str(shared / "iter_0000005"), non_persistent=True)
    assert layout.written_as(str(shared / "iter_0000001"), non_persistent=False)


def test_a_save_before_the_first_step_loads_and_changes_nothing(tmp_path: Path) -> None:
    """torch initialises an empty optimizer state with a zero step when it is gathered: neither
    the live optimizer nor the checkpoint may keep that step (the resume would diverge), and the
    checkpoint must load (it used to fail: "Missing key ... optim.state...step")."""
    model = make_model()
    opt = make_optimizer(model)
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 0, model, opt)
    assert not opt.state  # the save did not initialise the live optimizer
    fresh = make_model(seed=9)
    fresh_opt = make_optimizer(fresh)
    loaded = CheckpointManager(str(tmp_path)).load(fresh, fresh_opt)
    assert loaded is not None and loaded.iteration == 0 and not fresh_opt.state
    train_steps(model, opt, 2)
    train_steps(fresh, fresh_opt, 2)
    a, b = snapshot(model, opt), snapshot(fresh, fresh_opt)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key


@pytest.mark.parametrize("content", [b"\xff\xfe12\n", "²\n".encode(), b"12" * 100])
def test_a_garbage_tracker_names_the_file_and_fallback_applies(tmp_path: Path, content) -> None:
    model, opt = _trained()
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 1, model, opt)
    mgr.close()
    (tmp_path / layout.TRACKER_FILENAME).write_bytes(content)
    with pytest.raises(CheckpointError, match=layout.TRACKER_FILENAME) as info:
        CheckpointManager(str(tmp_path)).load(make_model(), None, load_optim=False)
    assert "\n" not in str(info.value)
    loaded = CheckpointManager(str(tmp_path), fallback=True).load(make_model(), None)
    assert loaded is not None and loaded.iteration == 1


def test_load_elsewhere_must_hold_a_checkpoint(tmp_path: Path, caplog) -> None:
    model = make_model()
    for load, match in ((tmp_path / "missing", "no such directory"),
                        (tmp_path, "no checkpoint there")):  # fmt: skip
        with pytest.raises(CheckpointError, match=f"--load {load}: {match}"):
            CheckpointManager(str(tmp_path / "save"), str(load)).load(model, None)
    caplog.set_level("INFO")
    fresh = tmp_path / "fresh"
    assert CheckpointManager(str(fresh), str(fresh)).load(model, None) is None  # --load = --save
    assert f"no checkpoint in {fresh}, starting from scratch" in caplog.text
    mgr = CheckpointManager(str(tmp_path / "a"))
    _save(mgr, 1, *_trained())
    mgr.close()
    with pytest.raises(CheckpointError, match="is one checkpoint: pass the directory"):
        CheckpointManager(None, str(tmp_path / "a" / "iter_0000001")).load(model, None)


def test_a_failed_async_save_is_one_line_with_the_os_cause(tmp_path: Path, monkeypatch) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    model, opt = _trained()
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    _save(mgr, 1, model, opt)
    mgr.finalize()
    monkeypatch.setattr(fs, "_write_item", full_disk)
    _save(mgr, 2, model, opt)
    with pytest.raises(CheckpointError) as info:
        mgr.finalize()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert "OSError: [Errno 28] No space left on device" in message, message
    cause = info.value.__cause__
    assert cause is not None and "No space left" in str(cause)  # the chain keeps the original
    assert layout.read_tracker(str(tmp_path)) == 1 and not layout.list_tmp_dirs(str(tmp_path))
    mgr.close()


def test_the_commit_hook_is_injected_not_read_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STALWART_TEST_CKPT_SLEEP_S", "30")  # the old test variable: ignored now
    seen: list[tuple[int, bool]] = []
    model, opt = _trained()

    def hook(iteration: int) -> None:  # inside the window: shards written, nothing committed
        seen.append((iteration, (tmp_path / f"iter_{iteration:07d}").exists()))

    mgr = CheckpointManager(str(tmp_path), before_commit=hook)
    started = time.monotonic()
    _save(mgr, 3, model, opt)
    assert time.monotonic() - started < 10 and seen == [(3, False)]
    mgr.close()


def test_state_json_round_trip_and_refusals() -> None:
    from stalwart.checkpoint.safe_state import StateFormatError, dumps_state, loads_state

    random.seed(3)
    np.random.seed(4)
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "bf16": torch.ones(3, dtype=torch.bfloat16),
             "int_keys": {1: "a", (2, 3): None}, "nan": float("nan"), "raw": b"\x00\xff",
             "__stalwart__": "a user key that looks like a tag", "empty": torch.empty(0, 2)}  # fmt: skip
    back = loads_state(dumps_state(state), "t")
    assert back["python"] == state["python"] and back["int_keys"] == state["int_keys"]
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert torch.equal(back["torch"], state["torch"]) and back["bf16"].dtype == torch.bfloat16
    assert back["nan"] != back["nan"] and back["raw"] == b"\x00\xff"
    assert back["__stalwart__"] == state["__stalwart__"] and back["empty"].shape == (0, 2)
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    with pytest.raises(StateFormatError, match=r"state\['x'\]: a builtins.object cannot"):
        dumps_state({"x": object()})
    with pytest.raises(StateFormatError, match="numpy dtype object"):
        dumps_state({"x": np.array([None], dtype=object)})
    for bad in (b"\x80\x04garbage", b'{"__stalwart__": "module", "name": "os"}',
                b'{"__stalwart__": "tensor", "dtype": "float32", "shape": [4], "base64": "AA=="}',
                b"[" * 100000):  # fmt: skip
        with pytest.raises(StateFormatError, match=r"^f: "):
            loads_state(bad, "f")


def _to_legacy(ckpt: Path) -> None:
    """Rewrite a checkpoint into the format of stalwart before JSON state (main 20e0679):
    ``common.pt``/``rank_*.pt`` written with torch.save of the same dicts."""
    from stalwart.checkpoint.safe_state import read_state_file

    for name in (layout.COMMON_FILENAME, layout.rank_filename(0)):
        torch.save(read_state_file(str(ckpt / name)), ckpt / name.replace(".json", ".pt"))
        (ckpt / name).unlink()


def test_legacy_checkpoints_convert_with_the_trusted_command(tmp_path: Path, capsys) -> None:
    from stalwart.cli.main import main

    model, opt = _trained()
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 1, model, opt)
    rng = torch.get_rng_state()
    _save(mgr, 2, model, opt)
    mgr.close()
    for it in (1, 2):
        _to_legacy(tmp_path / f"iter_{it:07d}")
    with pytest.raises(CheckpointError, match="convert --trust-pickle"):
        CheckpointManager(str(tmp_path)).load(make_model(), None)
    assert main(["checkpoints", "convert", str(tmp_path)]) == 2
    assert "--trust-pickle is required" in capsys.readouterr().err
    assert main(["checkpoints", "convert", "--trust-pickle", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("converted ") == 2
    fresh = make_model(seed=5)
    loaded = CheckpointManager(str(tmp_path)).load(fresh, make_optimizer(fresh))
    assert loaded is not None and loaded.iteration == 2
    assert loaded.per_rank is not None and torch.equal(loaded.per_rank["rng"], rng)
    assert not list(tmp_path.glob("iter_*/*.pt"))
    assert main(["checkpoints", "convert", "--trust-pickle", str(tmp_path)]) == 0
    assert "nothing to convert" in capsys.readouterr().out


def test_docstring_examples_run() -> None:
    import doctest

    from stalwart.checkpoint import lock, safe_state

    for module in (safe_state, lock):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
