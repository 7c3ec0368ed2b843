"""Helpers for trainer-level tests: a tiny, fast model config and parameter comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import RunConfig, build_run_config

REPO = Path(__file__).resolve().parents[1]

# ~0.6M parameters: a 20-iteration run takes about a second on one CPU core.
TINY_FLAGS = [
    "--preset", "tiny",
    "--num-layers", "1",
    "--hidden-size", "64",
    "--num-attention-heads", "2",
    "--seq-length", "32",
    "--vocab-size", "512",
    "--micro-batch-size", "4",
    "--lr", "1e-3",
    "--lr-warmup-iters", "2",
    "--log-interval", "5",
    "--no-progress-bar",
    "--use-cpu",
]  # fmt: skip


def make_config(*extra: str) -> RunConfig:
    argv = [*TINY_FLAGS, *extra]
    return build_run_config(parse_train_args(argv), argv)


def load_params(save_dir: str | Path, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Model parameters of a checkpoint, loaded into a fresh tiny GPT on CPU."""
    from stalwart.checkpoint import CheckpointManager
    from stalwart.models import GPT

    config = make_config()
    model = GPT(config.model)
    CheckpointManager(None, str(save_dir)).load(model, None, load_optim=False, iteration=iteration)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"parameter {key} differs"


def cli_command(
    args: list[str], *, nproc: int = 1, torchrun_args: list[str] | None = None
) -> list[str]:
    """The ``stalwart`` command line (under torchrun when ``nproc > 1`` or ``torchrun_args``)."""
    if nproc > 1 or torchrun_args:
        return [sys.executable, "-m", "stalwart.distributed.torchrun", "--standalone",
                "--nproc-per-node", str(nproc), *(torchrun_args or []),
                "-m", "stalwart", *args]  # fmt: skip
    return [sys.executable, "-m", "stalwart", *args]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def run_cli(
    args: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    torchrun_args: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``stalwart`` in a subprocess (under torchrun when ``nproc > 1``).

    ``torchrun_args`` go to torchrun before the module, e.g. ``["--max-restarts", "1"]``.
    """
    cmd = cli_command(args, nproc=nproc, torchrun_args=torchrun_args)
    return subprocess.run(
        cmd, capture_output=True, text=True, env=cli_env(env), timeout=timeout, cwd=REPO
    )
