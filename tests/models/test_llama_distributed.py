"""Two gloo ranks under FSDP2: a Llama model with full recompute trains bitwise like without.

FSDP2 shards every layer; with uniform recompute of 2 layers its per-layer all-gathers run inside
one recomputed unit, and again when backward recomputes it. (DDP only hooks the gradients, which
recompute leaves unchanged: the single-process tests cover it.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointManager
from stalwart.models import GPT

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, assert_params_equal, make_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LLAMA = ["--preset", "llama-tiny", "--num-layers", "2", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "96"]  # fmt: skip
COMMON = ["train", *TINY_FLAGS, *LLAMA, "--train-iters", "4", "--seed", "3",
          "--global-batch-size", "16", "--hidden-dropout", "0.1"]  # fmt: skip
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "2"]  # fmt: skip


def _params(save: Path) -> dict[str, torch.Tensor]:
    model = GPT(make_config(*LLAMA).model)
    CheckpointManager(None, str(save)).load(model, None, load_optim=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fsdp2_two_ranks_recompute_is_bitwise(tmp_path: Path) -> None:
    runs = {}
    for name, extra in {"plain": [], "full": FULL}.items():
        save = tmp_path / name
        proc = run_cli_on_ranks(
            [*COMMON, "--use-torch-fsdp2", *extra, "--save", str(save)], tmp_path / f"{name}-logs"
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs[name] = _params(save)
    assert_params_equal(runs["plain"], runs["full"])
