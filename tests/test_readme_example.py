"""The hand-written-loop example in README.md runs as written, on the reference GPT.

It is run as three "jobs" (fresh objects each time, as a relaunch would build them) with a
persistent error injected into iteration 4: exit 16 with a checkpoint, the restart on the same
device exits 16 again, the restart on another device (``STALWART_DEVICE_ID``) reruns iteration 4
there and exits 17 with the diagnosis. The checkpoint and the rerun's result equal bitwise what
the reference trainer writes for the same job.
"""

from __future__ import annotations

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
