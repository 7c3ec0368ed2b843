"""``--bf16-compute-weights`` under DDP (issue 19): the forward runs on bf16 copies, so DDP's
hooks on the fp32 parameters never fire; the guarded step runs the micro-batches on the unwrapped
module and averages the fp32 gradients itself after the pass (`stalwart.loop.data_parallel_grads`).

Two gloo ranks with different data train a tiny GPT for a few guarded iterations, with and
without the copies, under DDP. Tolerances:

* untied embeddings: bitwise. The local gradients are autocast's bit for bit (the single-rank
  kernel-floor test shows it), and the reduction is DDP's: each element divided by the world size
  (exact, a power of two) then summed over two ranks (a + b = b + a exactly);
* tied embeddings: within 1e-6 absolute, the single-rank bound: only the order of the two fp32
  additions into the embedding's gradient (lookup, output layer's copy) differs;
* every rank ends with the same parameters, bitwise;
* a NaN in one weight's gradient on rank 0 only (the loss stays finite) is caught by the
  per-bucket gradient checks in both paths alike: the same verdict on both ranks, the step not
  taken (the parameters stay finite).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dist_utils import run_distributed

ITERS, MICRO = 3, 2


def _job(rank: int, *, weights: bool, tied: bool, nan_call: int = -1) -> dict[str, Any]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from stalwart.graphs import make_capturable_adamw
    from stalwart.loop import ComputeWeights, GuardedStep
    from stalwart.models import GPT, GPTConfig
    from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                    vocab_size=64, dropout=0.1, untie_embeddings_and_output_weights=not tied)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    gen = torch.Generator().manual_seed(5 + rank)  # each rank its own data: the mean matters
    batches = []
    for _ in range(4 * ITERS * MICRO):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        batches.append({"ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    calls = [0]

    def forward(batch: dict[str, torch.Tensor], module: nn.Module) -> Any:
        out = module(batch["ids"], batch["labels"])
        if rank == 0 and calls[0] == nan_call:
            # A NaN gradient into the first Linear's weight (the copy when there are copies),
            # the loss unchanged: only the gradient checks can see it.
            weight = next(m for m in module.modules() if isinstance(m, nn.Linear)).weight
            out["loss"] = out["loss"] + 0.0 * torch.sqrt(weight.float().sum() * 0.0)
        calls[0] += 1
        return out

    optimizer = make_capturable_adamw(
        list(model.parameters()), lr=1e-2, device=torch.device("cpu"), fused=True
    )
    step = GuardedStep(
        model=ddp, optimizer=optimizer, forward_step=forward,
        machine=RerunConfig().build("cpu"), data=RerunDataIterator(batches),
        num_microbatches=MICRO, clip_grad=0.5, lookahead=False,
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        compute_weights=ComputeWeights(model) if weights else None,
    )  # fmt: skip
    torch.manual_seed(7 + rank)  # dropout draws: the same in both paths
    verdicts, losses = [], []
    for it in range(ITERS):
        result = step.run(it + 1, launch_next=False)
        verdicts.append((result.verdict.exit, result.verdict.exit_code, result.skipped))
        losses.append(float(result.losses["lm loss"]) if "lm loss" in result.losses else None)
        if result.verdict.exit:
            break
    step.close()
    return {
        # numpy: a tensor through the result queue would need the finished rank's shared memory.
        "params": [p.detach().numpy().copy() for p in model.parameters()],
        "verdicts": verdicts,
        "losses": losses,
    }


SHAPE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2"]  # fmt: skip


def _trainer(rank: int, world_size: int) -> dict[str, Any]:
    """The reference trainer's wiring: ``--bf16-compute-weights`` on two DDP ranks."""
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config
    from stalwart.distributed.process_group import DistributedContext
    from stalwart.loop.data_parallel_grads import ReducedGradChecks
    from stalwart.train.trainer import Trainer

    argv = ["--preset", "tiny", *SHAPE, "--use-cpu", "--bf16", "--bf16-compute-weights",
            "--train-iters", "2", "--global-batch-size", "8", "--no-progress-bar"]  # fmt: skip
    config = build_run_config(parse_train_args(argv), argv)
    ctx = DistributedContext(rank, world_size, rank, torch.device("cpu"), "gloo")
    trainer = Trainer(config, ctx, print_fn=lambda *_: None)
    try:
        fb = trainer.step.runners.forward_backward
        wiring = (type(fb.grad_checks) is ReducedGradChecks, fb.model is trainer.raw_model)
        losses = [float(trainer.step.run(it, launch_next=False).losses["lm loss"]) for it in (1, 2)]
        params = [p.detach().numpy().copy() for p in trainer.raw_model.parameters()]
    finally:
        trainer.close()
    return {"wiring": wiring, "losses": losses, "params": params}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    out = {"trainer": _trainer(rank, world_size)}
    for tied in (False, True):
        out[f"plain-{tied}"] = _job(rank, weights=False, tied=tied)
        out[f"copies-{tied}"] = _job(rank, weights=True, tied=tied)
    out["plain-nan"] = _job(rank, weights=False, tied=False, nan_call=2)
    out["copies-nan"] = _job(rank, weights=True, tied=False, nan_call=2)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_body, world_size=2)


def _equal(a: list[Any], b: list[Any], atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(map(torch.from_numpy, a), map(torch.from_numpy, b), strict=True):
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        if atol == 0.0:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0.0, atol=atol)


@pytest.mark.parametrize(("tied", "atol"), [(False, 0.0), (True, 1e-6)], ids=["untied", "tied"])
def test_compute_weights_under_ddp_equal_plain_ddp(ranks, tied: bool, atol: float) -> None:
    for rank in ranks:
        plain, copies = rank[f"plain-{tied}"], rank[f"copies-{tied}"]
        assert [v[0] for v in copies["verdicts"]] == [False] * ITERS
        if atol == 0.0:
            assert copies["losses"] == plain["losses"]
        _equal(copies["params"], plain["params"], atol)
    # The replicas stay replicas: every rank holds the same parameters, bitwise (each rank has
    # its own data, so without the reduction they would drift apart at the first step).
    _equal(ranks[0][f"copies-{tied}"]["params"], ranks[1][f"copies-{tied}"]["params"])


def test_the_trainer_runs_compute_weights_under_ddp(ranks) -> None:
    for rank in ranks:
        assert rank["trainer"]["wiring"] == (True, True)  # the unwrapped module, our reduction
        assert all(math.isfinite(loss) for loss in rank["trainer"]["losses"])
    _equal(ranks[0]["trainer"]["params"], ranks[1]["trainer"]["params"])


def test_a_nan_gradient_on_one_rank_is_caught_per_bucket_as_with_plain_ddp(ranks) -> None:
    for rank in ranks:
        plain, copies = rank["plain-nan"], rank["copies-nan"]
        assert copies["verdicts"] == plain["verdicts"]
        assert any(skipped for _, _, skipped in copies["verdicts"])  # the NaN step not taken
        _equal(copies["params"], plain["params"])
    assert ranks[0]["copies-nan"]["verdicts"] == ranks[1]["copies-nan"]["verdicts"]
