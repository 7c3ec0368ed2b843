"""``--profile``: a torch.profiler window over exactly the chosen iterations, Megatron's flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.observability.profiler import (
    NullProfilerWindow,
    ProfilerConfig,
    TorchProfilerWindow,
)
from stalwart.train.trainer import run_training

from train_utils import TINY_FLAGS, make_config


def _iteration_ranges(trace_path) -> list[str]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    return sorted(n for n in names if n.startswith("iteration "))


def test_trace_covers_exactly_the_window(tmp_path) -> None:
    """Start 2, end 4: the iterations logged as 3 and 4, each a named range with real ops."""
    args = ["--train-iters", "6", "--run-dir", str(tmp_path), "--profile",
            "--profile-step-start", "2", "--profile-step-end", "4", "--use-pytorch-profiler"]  # fmt: skip
    run_training(make_config(*args), DistributedContext())
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == [
        "ops_rank0_iters3-4.txt",
        "trace_rank0_iters3-4.json",
    ]
    assert _iteration_ranges(out / "trace_rank0_iters3-4.json") == ["iteration 3", "iteration 4"]
    table = (out / "ops_rank0_iters3-4.txt").read_text()
    assert "aten::" in table and "Self CPU" in table


def test_an_exit_inside_the_window_still_writes_the_trace(tmp_path) -> None:
    args = ["--train-iters", "10", "--run-dir", str(tmp_path), "--profile", "--exit-interval", "3",
            "--profile-step-start", "1", "--profile-step-end", "5", "--use-pytorch-profiler",
            "--profile-dir", str(tmp_path / "traces")]  # fmt: skip
    assert run_training(make_config(*args), DistributedContext()).iteration == 3
    trace = tmp_path / "traces" / "trace_rank0_iters2-exit.json"
    assert _iteration_ranges(trace) == ["iteration 2", "iteration 3"]


def test_resume_inside_the_window_profiles_the_rest(tmp_path) -> None:
    window = TorchProfilerWindow(2, 5, str(tmp_path), 0, torch.device("cpu"))
    for completed in range(3, 7):  # resumed after 3 completed iterations
        window.on_iteration_start(completed)
        torch.ones(4) @ torch.ones(4)
        window.on_iteration_end(completed + 1)
    window.close()
    assert window.trace_path is not None and window.trace_path.endswith("iters4-5.json")
    assert _iteration_ranges(tmp_path / "trace_rank0_iters4-5.json") == [
        "iteration 4",
        "iteration 5",
    ]


def test_only_the_chosen_ranks_profile() -> None:
    on = ProfilerConfig(profile=True, profile_step_start=1, profile_step_end=2,
                        profile_ranks=[1, 3], use_pytorch_profiler=True)  # fmt: skip
    kwargs = {"world_size": 4, "device": torch.device("cpu"), "run_dir": "."}
    assert isinstance(on.build(rank=0, **kwargs), NullProfilerWindow)
    assert isinstance(on.build(rank=3, **kwargs), TorchProfilerWindow)
    off = dataclasses.replace(on, profile=False)
    assert isinstance(off.build(rank=3, **kwargs), NullProfilerWindow)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--profile", "--profile-step-start", "5", "--profile-step-end", "5",
          "--use-pytorch-profiler"], "--profile-step-end"),
        (["--profile", "--profile-step-start", "-1", "--use-pytorch-profiler"],
         "--profile-step-start"),
        (["--profile", "--profile-ranks", "-2", "--use-pytorch-profiler"], "--profile-ranks"),
        (["--profile"], "--use-pytorch-profiler"),  # no CUDA here: nsys range impossible
        (["--profile", "--profile-ranks", "3", "--use-pytorch-profiler"], "no such rank"),
    ],
)  # fmt: skip
def test_bad_profile_flags_exit_2_with_one_line(args, needle, capsys) -> None:
    assert main(["train", *TINY_FLAGS, "--train-iters", "2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err
