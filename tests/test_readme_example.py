"""The hand-written-loop example in README.md runs as written, on the reference GPT.

It is run as three "jobs" (fresh objects each time, as a relaunch would build them) with a
persistent error injected into iteration 4: exit 16 with a checkpoint, the restart on the same
device exits 16 again, the restart on another device (``STALWART_DEVICE_ID``) reruns iteration 4
there and exits 17 with the diagnosis. The checkpoint and the rerun's result equal bitwise what
the reference trainer writes for the same job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.faults import NullFaultInjector
from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunDataIterator
from stalwart.train import build
from stalwart.train.forward_step import gpt_forward_step
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config

README = Path(__file__).resolve().parents[1] / "README.md"
# Constant LR: the README loop has no schedule. Two micro-batches per iteration.
FLAGS = ["--train-iters", "6", "--seed", "5", "--lr-warmup-iters", "0",
         "--lr-decay-style", "constant", "--global-batch-size", "8"]  # fmt: skip
LOGGED = 4  # the injected iteration, numbered as logged


def _python_blocks(heading: str = "Using the parts in your own loop") -> list[str]:
    """The python blocks of the README section under ``## heading``."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def _rerun_flags(tracker: Path) -> dict[str, Any]:
    return {
        "result_rejected_tracker_filename": str(tracker),
        "error_injection_rate": 1,
        "error_injection_type": "persistent_error",
        "error_injection_iterations": [LOGGED],
    }


def _job(save: Path, tracker: Path) -> int:
    """One run of the README block with the trainer's model, optimizer and data; exit code."""
    config = make_config(*FLAGS)
    ctx = DistributedContext()
    data = build.build_data(config, ctx)
    _, model = build.build_model(config, ctx, NullFaultInjector())
    namespace = {
        "my_model": model,
        "my_optimizer": build.build_optimizer(model, config),
        "my_batches": build.build_sampler(config, ctx, data.train),
        "my_forward_step": gpt_forward_step,
        "my_rerun_flags": _rerun_flags(tracker),
        "device": torch.device("cpu"),
        "n": config.training.train_iters,
        "save_dir": str(save),
    }
    (block,) = _python_blocks()
    with pytest.raises(SystemExit) as info:
        exec(compile(block, str(README), "exec"), namespace)
    assert isinstance(namespace["data"], RerunDataIterator)
    return int(info.value.code or 0)


def _trainer_job(save: Path, tracker: Path) -> int:
    flags = [*FLAGS, "--save", str(save), "--result-rejected-tracker-filename", str(tracker),
             "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
             "--error-injection-iterations", str(LOGGED)]  # fmt: skip
    return run_training(make_config(*flags), DistributedContext()).exit_code


def _statuses_and_results(tracker: Path) -> list[tuple[str, str]]:
    lines = tracker.read_text().splitlines()
    assert all(f"iteration={LOGGED} " in line for line in lines), lines
    return [
        (line.split(" status=")[1].split()[0], line.split(" result=")[1].split()[0])
        for line in lines
    ]


def test_readme_loop_exits_16_then_17_on_another_device_like_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    codes: dict[str, list[int]] = {"readme": [], "trainer": []}
    for name, job in (("readme", _job), ("trainer", _trainer_job)):
        save, tracker = tmp_path / name, tmp_path / f"{name}.txt"
        monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
        codes[name].append(job(save, tracker))
        # The same fault reports the same iteration on every path: the completed ones.
        assert json.loads((save / "exit_reason.json").read_text())["iteration"] == LOGGED - 1
        codes[name].append(job(save, tracker))  # rescheduled on the same GPU
        monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
        codes[name].append(job(save, tracker))
    assert codes["readme"] == codes["trainer"] == [16, 16, 17]
    readme, trainer = tmp_path / "readme", tmp_path / "trainer"
    assert (readme / "latest_checkpointed_iteration.txt").read_text() == f"{LOGGED - 1}\n"
    assert_params_equal(load_params(readme, LOGGED - 1), load_params(trainer, LOGGED - 1))
    # The rerun on gpu-b replayed iteration 4 from the checkpointed data position and RNG: the
    # same clean value as the trainer's, bitwise.
    ours, theirs = (_statuses_and_results(tmp_path / f"{n}.txt") for n in ("readme", "trainer"))
    assert [s for s, _ in ours] == [
        "initial_run", "first_rerun_reproducible", "second_rerun_not_reproducible"
    ]  # fmt: skip
    assert ours == theirs
    assert float(ours[-1][1]) == float(ours[-1][1])  # a finite, clean value (not NaN)
    assert "exit_code" in (readme / "exit_reason.json").read_text()


# The README block as a user copies it into a script: the tiny GPT, the trainer's data, and a
# stand-in for the scheduler's SIGTERM (the micro-batch at AT waits until the test has sent it).
SCRIPT = """
import os, pathlib, sys, time
sys.path.insert(0, {tests!r})
import torch
from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.faults import NullFaultInjector
from stalwart.train import build
from stalwart.train.forward_step import gpt_forward_step
from train_utils import make_config

config = make_config(*{flags!r})
ctx = DistributedContext()
data = build.build_data(config, ctx)
_, model = build.build_model(config, ctx, NullFaultInjector())
marker, ack = os.environ.get("MARKER"), os.environ.get("ACK")

def batches(source):
    for i, batch in enumerate(source):
        if marker and i == {at}:
            pathlib.Path(marker).write_text("here")
            while not os.path.exists(ack):  # the SIGTERM reached this process first
                time.sleep(0.01)
        yield batch

my_model, device, n, save_dir = model, torch.device("cpu"), config.training.train_iters, {save!r}
my_optimizer = build.build_optimizer(model, config)
my_batches = batches(build.build_sampler(config, ctx, data.train))
my_forward_step, my_rerun_flags = gpt_forward_step, {{}}
"""
SIGTERM_ITERS = 8


def _script(tmp_path: Path, name: str, save: Path, block: str) -> Path:
    flags = [*FLAGS[:1], str(SIGTERM_ITERS), *FLAGS[2:]]
    prelude = SCRIPT.format(
        tests=str(README.parent / "tests"), flags=flags, at=2 * 3, save=str(save)
    )
    path = tmp_path / f"{name}.py"
    path.write_text(prelude + block)
    return path


def _run_script(path: Path, sigterm: bool) -> int:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=str(README.parent / "src"))
    if sigterm:
        env.update(MARKER=str(path.with_suffix(".here")), ACK=str(path.with_suffix(".ack")))
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        env=env,
        cwd=path.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if sigterm:
        deadline = time.monotonic() + 120
        while not path.with_suffix(".here").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)  # a scheduler's preemption: kill -TERM
        path.with_suffix(".ack").write_text("sent")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode in (0, 16, 17), out[-3000:]
    return proc.returncode


@pytest.mark.parametrize("exit_config", ["as written", "save_interval=2"])
def test_the_readme_loop_saves_on_sigterm_exits_0_and_resumes_bitwise(
    tmp_path: Path, exit_config: str
) -> None:
    """Whatever ExitConfig the loop passes (the README's ``save_interval=100``; a loop's own
    ``save_interval=2``), SIGTERM saves, exits 0 and the relaunch ends bitwise equal to the
    run that was not stopped (issue 41: the handler was off with any ExitConfig)."""
    (block,) = _python_blocks()
    if exit_config != "as written":
        assert "ExitConfig(save_interval=100)" in block
        block = block.replace("ExitConfig(save_interval=100)", f"ExitConfig({exit_config})")
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert _run_script(_script(tmp_path, "reference", reference, block), sigterm=False) == 0
    script = _script(tmp_path, "stopped", stopped, block)
    assert _run_script(script, sigterm=True) == 0
    reason = json.loads((stopped / "exit_reason.json").read_text())
    assert reason["reason"] == "signal" and 3 <= reason["iteration"] < SIGTERM_ITERS, reason
    assert not list(stopped.glob("iter_*.tmp-*"))  # the save completed
    saved = int((stopped / "latest_checkpointed_iteration.txt").read_text())
    assert saved == reason["iteration"]
    assert _run_script(script, sigterm=False) == 0  # the relaunch resumes and finishes
    assert json.loads((stopped / "exit_reason.json").read_text())["iteration"] == SIGTERM_ITERS
    assert_params_equal(load_params(stopped, SIGTERM_ITERS), load_params(reference, SIGTERM_ITERS))
