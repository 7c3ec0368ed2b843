"""``stalwart launch --fork-workers`` over the real trainer: 2 gloo ranks forked from the
launcher, rank 0 dies of an injected exception, the launcher relaunches (forked again) and the
job resumes to the end, bitwise equal to the fault-free job; a forked worker starts with an exec'd
worker's process state (signal handlers, exit handlers)."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import summarize

from dist_utils import run_cli_on_ranks
from train_utils import REPO, TINY_FLAGS, assert_params_equal, load_params

ITERS = 6
TRAIN = [*TINY_FLAGS, "--train-iters", str(ITERS), "--global-batch-size", "8", "--seed", "3",
         "--save-interval", "2", "--log-interval", "1"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_forked_workers_restart_after_a_crash_bitwise_equal(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "stalwart", "launch", "--fork-workers", "--nproc-per-node", "2",
           "--devices", "a,b", "--max-restarts", "1", "--monitor-interval", "0.2", "--", *TRAIN,
           "--save", str(save), "--inject-fault", "exception", "--inject-fault-iteration", "4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert log.count("stalwart launch: forking the workers from the launcher") == 2, log[-3000:]
    assert "stalwart launch: restart: rank 0 exited 1 (a failure)" in log
    summary = summarize(read_ledger(save / "goodput.jsonl"))
    assert [a.get("action") for a in summary.actions] == ["restart", "finished"]
    assert summary.sessions[-1].resumed_at == 2 and summary.sessions[-1].end_reason == "finished"

    ref = run_cli_on_ranks(["train", *TRAIN, "--save", str(tmp_path / "ref")], tmp_path / "logs",
                           world_size=2, timeout_s=240)  # fmt: skip
    assert ref.codes == [0, 0], ref.log[-3000:]
    assert_params_equal(load_params(save, ITERS), load_params(tmp_path / "ref", ITERS))


@pytest.mark.distributed
def test_sigterm_to_the_launcher_forked_workers_save_and_it_exits_at_once(tmp_path: Path) -> None:
    """Preemption: the agent forwards SIGTERM, the forked workers save and return, and the
    launcher exits 143 without waiting out torch's 30 s for workers it no longer reads."""
    import time

    save = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    train = [*TINY_FLAGS, "--train-iters", "1000000", "--global-batch-size", "8",
             "--save-interval", "100000", "--exit-signal-handler", "--save", str(save)]  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "launch", "--fork-workers", "--nproc-per-node", "2",
           "--devices", "a,b", "--max-restarts", "1", "--monitor-interval", "0.2", "--", *train]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = save / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        proc.kill()
    assert proc.returncode == 143, log[-3000:]
    assert "stalwart launch: preempted" in log and "forcefully exiting" not in log, log[-3000:]
    assert took < 20, took  # torch's own wait for unread workers is 30 s
    assert (save / "latest_checkpointed_iteration.txt").exists()


def _child(marker: str, argv: tuple[str, ...]) -> None:
    from stalwart.cli.launch import forked_worker

    try:
        forked_worker(*argv)
    finally:
        handler = signal.getsignal(signal.SIGTERM)
        Path(marker).write_text("default" if handler == signal.SIG_DFL else repr(handler))


def test_a_forked_worker_starts_with_default_handlers_and_its_own_exit_code(
    tmp_path: Path,
) -> None:
    launcher_exit = tmp_path / "launcher_atexit"
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as torchrun's agent does

    def launcher_handler() -> None:
        launcher_exit.write_text("ran")

    atexit.register(launcher_handler)
    try:
        marker = tmp_path / "sigterm"
        child = multiprocessing.get_context("fork").Process(
            target=_child, args=(str(marker), ("train", "--no-such-flag"))
        )
        child.start()
        child.join(60)
    finally:
        atexit.unregister(launcher_handler)
        signal.signal(signal.SIGTERM, previous)
    assert child.exitcode == 2  # bad input, as `python -m stalwart train --no-such-flag`
    assert marker.read_text() == "default"
    assert not launcher_exit.exists()  # the launcher's exit handler did not run in the worker


def test_a_launcher_with_cuda_initialised_execs_the_round_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from stalwart.distributed.launch import _forked_launch

    calls: list[tuple[object, object]] = []

    def launch(config: object, entrypoint: object) -> object:
        calls.append((config, entrypoint))
        return lambda *args: args

    def worker(*argv: str) -> None:
        raise AssertionError("not forked")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    forked = _forked_launch(launch, worker, "config", "/usr/bin/python")
    assert calls == [("config", "/usr/bin/python")]  # torchrun's exec entrypoint, unchanged
    assert forked("-u", "-m", "stalwart", "train") == ("-u", "-m", "stalwart", "train")
    assert "CUDA is initialised in the launcher" in capsys.readouterr().err


def test_the_forked_round_runs_the_worker_with_the_args_after_the_module() -> None:
    import dataclasses

    from stalwart.distributed.launch import _forked_launch

    @dataclasses.dataclass
    class Config:
        start_method: str = "spawn"

    seen: list[tuple[object, object]] = []

    def launch(config: Config, entrypoint: object) -> object:
        seen.append((config.start_method, entrypoint))
        return lambda *args: args

    def worker(*argv: str) -> None: ...

    forked = _forked_launch(launch, worker, Config(), "/usr/bin/python")
    assert seen == [("fork", worker)]
    assert forked("-u", "-m", "stalwart", "train", "--save", "x") == ("train", "--save", "x")


def test_the_launcher_imports_a_restart_s_modules_without_initialising_cuda() -> None:
    code = (
        "import json, sys, torch\n"
        "from stalwart.cli.launch import COMPILE_IMPORTS, RESTART_IMPORTS, forking_worker\n"
        "fresh = [n for n in RESTART_IMPORTS + COMPILE_IMPORTS if n not in sys.modules]\n"
        "forking_worker(compiles=True)\n"
        "left = [n for n in fresh if n not in sys.modules]\n"
        "print(json.dumps([len(fresh), left, torch.cuda.is_initialized()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO, check=True).stdout  # fmt: skip
    fresh, left, cuda = json.loads(out)
    assert fresh >= 10  # most of them are not imported by the trainer itself
    # Only what this torch lacks is passed over (the CPU wheel has no Triton).
    assert set(left) <= {"triton.compiler.compiler", "psutil"}
    assert cuda is False


def test_the_launcher_imports_dynamo_for_ddp_without_compile() -> None:
    """DDP's constructor imports Dynamo: a forked worker must find it imported (not import it
    at every restart), and the launcher must not import it while it logs a failed round."""
    code = (
        "import json, sys, torch\n"
        "from stalwart.cli.launch import forking_worker\n"
        "before = 'torch._dynamo' in sys.modules\n"
        "forking_worker(compiles=False)\n"
        "print(json.dumps([before, 'torch._dynamo' in sys.modules, torch.cuda.is_initialized()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO, check=True).stdout  # fmt: skip
    assert json.loads(out) == [False, True, False]
