"""Warm restarts in the trainer: the compile cache's flags, and the goodput ledger's compile
bucket across an in-process restart (the rebuilt model compiles nothing)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT
from stalwart.observability.goodput import Bucket, CompileSource
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import Span, summarize
from stalwart.reliability.inprocess.store import RestartStore
from stalwart.reliability.inprocess.wrapper import InProcessRestarter, RestartOptions
from stalwart.train.build import build_compile_cache
from stalwart.train.inprocess import trainer_attempt

from train_utils import TINY_FLAGS, make_config


def _train_exit(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["train", *TINY_FLAGS, "--train-iters", "1", *flags]))
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return int(info.value.code or 0), err


def test_a_world_writable_compile_cache_dir_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    code, err = _train_exit(capsys, "--compile", "--compile-cache-dir", str(cache))
    assert code == 2
    assert "--compile-cache-dir" in err and "writable by every user" in err, err
    assert "generated code that the run executes" in err


def test_the_default_cache_under_the_run_dir_is_checked_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "compile_cache").mkdir(parents=True)
    (run_dir / "compile_cache").chmod(0o777)
    code, err = _train_exit(capsys, "--compile", "--run-dir", str(run_dir))
    assert code == 2 and "--run-dir's compile cache" in err, err


def test_a_cache_in_another_runs_checkpoint_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--compile-cache-dir <another run>/iter_N/cc`` would change that run's checkpoint (its
    manifest no longer matches: ``stalwart checkpoints --verify`` fails)."""
    checkpoint = tmp_path / "other_run" / "iter_0000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("{}\n")
    code, err = _train_exit(capsys, "--compile", "--compile-cache-dir", str(checkpoint / "cc"))
    assert code == 2 and "inside the checkpoint directory" in err, err
    assert not (checkpoint / "cc").exists()


def test_a_run_dir_others_can_write_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory made under umask 002: a group member could swap the default cache."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o775)
    code, err = _train_exit(capsys, "--compile", "--run-dir", str(run_dir))
    assert code == 2 and "--run-dir's compile cache" in err, err
    assert "writable by its group without the sticky bit" in err, err
    assert not (run_dir / "compile_cache").exists()


def test_compile_cache_dir_without_compile_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _train_exit(capsys, "--compile-cache-dir", str(tmp_path))
    assert code == 2 and "--compile-cache-dir needs --compile" in err, err


def test_the_cache_location_follows_the_run_dir(tmp_path: Path) -> None:
    assert make_config("--compile").compile_cache_location() is None  # nowhere to relaunch into
    assert make_config("--save", str(tmp_path)).compile_cache_location() is None  # no --compile
    flag, where = make_config("--compile", "--save", str(tmp_path)).compile_cache_location()  # type: ignore[misc]
    assert where == os.path.join(tmp_path, "compile_cache") and flag.startswith("--save")
    given = str(tmp_path / "mine")
    config = make_config("--compile", "--save", str(tmp_path), "--compile-cache-dir", given)
    assert config.compile_cache_location() == ("--compile-cache-dir", given)


def _eager_compile(self: nn.Module, **kwargs: Any) -> None:
    """Dynamo with the eager backend: the trainer's compile path at a fraction of Inductor's
    CPU cost (what is measured here is whether Dynamo compiles, not what Inductor makes)."""
    nn.Module.compile(self, backend="eager", dynamic=False)


def test_an_inprocess_restart_books_no_compile_for_the_rebuilt_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(GPT, "compile", _eager_compile)
    save = tmp_path / "run"
    config = make_config(
        "--compile", "--save", str(save), "--save-interval", "2", "--train-iters", "4",
        "--log-interval", "1", "--inprocess-restart", "--inject-fault", "exception",
        "--inject-fault-iteration", "3", "--inject-fault-rank", "0",
    )  # fmt: skip
    restarter = InProcessRestarter(
        RestartOptions(heartbeat_interval=0.05, no_retry=(ValueError,)),
        lambda store: DistributedContext(),
        store=RestartStore.local(),
        say=lambda line: None,
    )
    with build_compile_cache(config, 0) as cache:
        outcome = restarter.run(trainer_attempt(config, cache))
    assert outcome.exit_code == 0 and outcome.iteration == 4
    ledger = read_ledger(save / "goodput.jsonl")
    spans = [r for r in ledger.records if isinstance(r, Span)]
    attempts = {s.session.rsplit("-", 2)[1] for s in spans}
    assert attempts == {"0", "1"}, spans
    compiles = [
        (s.session.rsplit("-", 2)[1], s.source) for s in spans if s.bucket is Bucket.COMPILE
    ]
    # Attempt 0's first iteration compiled (eager backend: no Inductor cache, so "cold");
    # attempt 1 rebuilt the model, which reused Dynamo's code: its iterations are not compile.
    assert compiles[0] == ("0", CompileSource.COLD) and {a for a, _ in compiles} == {"0"}, spans
    assert any(s.bucket is Bucket.PRODUCTIVE and s.session.rsplit("-", 2)[1] == "1" for s in spans)
    assert set(summarize(ledger).compile_sources) <= {"cold", "save"}


@pytest.mark.slow
def test_a_warm_relaunch_reloads_nothing_and_ends_bitwise_equal(tmp_path: Path) -> None:
    """A job with --compile dies at iteration 3 and is relaunched: the relaunch compiles
    nothing (torch's FX-graph and AOTAutograd caches under the run directory), does not write
    artifacts.bin's entries into them again (the stamp), and ends bitwise equal to the job
    that did not stop (which compiles nothing either: the same cache)."""
    import subprocess
    import sys

    from stalwart.compile.cache import DEFAULT_CACHE_DIRNAME, INDUCTOR_DIR, STAMP_FILE

    from train_utils import REPO, assert_params_equal, load_params

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    faulted, full = tmp_path / "faulted", tmp_path / "full"
    cache = faulted / DEFAULT_CACHE_DIRNAME
    flags = [*TINY_FLAGS, "--compile", "--train-iters", "6", "--save-interval", "2",
             "--log-interval", "1", "--seed", "3", "--eval-interval", "0"]  # fmt: skip
    runs = [
        ([*flags, "--save", str(faulted), "--inject-fault", "exception",
          "--inject-fault-iteration", "3"], 1),
        ([*flags, "--save", str(faulted)], 0),
        ([*flags, "--save", str(full), "--compile-cache-dir", str(cache)], 0),
    ]  # fmt: skip
    for argv, code in runs:
        done = subprocess.run([sys.executable, "-m", "stalwart", "train", *argv], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == code, done.stdout[-2000:] + done.stderr[-3000:]
        if argv is runs[0][0]:
            stamp = (cache / INDUCTOR_DIR / STAMP_FILE).stat().st_mtime_ns
    assert (cache / INDUCTOR_DIR / STAMP_FILE).stat().st_mtime_ns == stamp  # no load restamped
    sessions = summarize(read_ledger(faulted / "goodput.jsonl")).sessions
    assert len(sessions) == 2
    spans = [r for r in read_ledger(faulted / "goodput.jsonl").records if isinstance(r, Span)]
    relaunch = [s.source for s in spans if s.bucket is Bucket.COMPILE and s.session == sessions[1].session]  # fmt: skip
    assert relaunch and set(relaunch) == {CompileSource.WARM}, relaunch
    assert_params_equal(load_params(faulted, 6), load_params(full, 6))
