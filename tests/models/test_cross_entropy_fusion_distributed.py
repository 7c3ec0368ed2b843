"""``--cross-entropy-loss-fusion`` on two gloo ranks: under DDP (GPT-2, tied output layer) and
under FSDP2 (Llama, untied: the output layer's weight is all-gathered from shards), the fused loss
trains the run the unfused loss trains, to float rounding (4 iterations, dropout on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointManager
from stalwart.models import GPT

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, make_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LLAMA = ["--preset", "llama-tiny", "--num-layers", "2", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "96"]  # fmt: skip
COMMON = ["train", *TINY_FLAGS, "--train-iters", "4", "--seed", "3", "--global-batch-size", "16",
          "--hidden-dropout", "0.1"]  # fmt: skip


def _params(save: Path, model_flags: list[str]) -> tuple[dict[str, torch.Tensor], bool]:
    """The saved weights, and whether the run's saved config had the fused loss on."""
    model = GPT(make_config(*model_flags).model)
    common: dict = {}
    CheckpointManager(None, str(save)).load(
        model, None, load_optim=False, check_common=common.update
    )
    fused = common["config"]["model"]["cross_entropy_loss_fusion"]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, fused


@pytest.mark.parametrize(
    "model_flags", [[], [*LLAMA, "--use-torch-fsdp2"]], ids=["ddp-gpt2-tied", "fsdp2-llama"]
)
def test_fused_loss_trains_the_same_run_on_two_ranks(
    tmp_path: Path, model_flags: list[str]
) -> None:
    runs = {}
    for name, extra in {"plain": [], "fused": ["--cross-entropy-loss-fusion"]}.items():
        save = tmp_path / name
        argv = [*COMMON, *model_flags, *extra, "--save", str(save)]
        proc = run_cli_on_ranks(argv, tmp_path / f"{name}-logs")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        params, fused = _params(save, [f for f in model_flags if f != "--use-torch-fsdp2"])
        assert fused is (name == "fused")
        runs[name] = params
    assert runs["plain"].keys() == runs["fused"].keys()
    for key, plain in runs["plain"].items():
        torch.testing.assert_close(runs["fused"][key], plain, rtol=1e-4, atol=1e-5, msg=key)
