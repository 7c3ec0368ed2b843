"""The kernel-floor ingredients (issue 19) on CPU, in the eager form of the code a graph captures.

Each ingredient trains a tiny GPT for a few guarded iterations next to the plain path (same
seed, data and dropout draws), and the final parameters are compared:

* bf16 compute weights (``ComputeWeights``): bitwise equal to plain bf16 autocast, with untied
  embeddings, dropout and full recompute (the recomputed forward must see the copies); within
  1e-6 with tied embeddings (only the order of two fp32 additions into the embedding differs);
* the optimizer step inside the full-iteration graph (``GraphPlan(optimizer_in_graph=True)`` on
  the fake graph backend, staying in eager warm-up, i.e. the very function a capture records):
  bitwise equal to the eager gated step, also when a NaN rejects an iteration whose step the
  graph already enqueued (the device skips it, the rerun steps after the read);
* the bf16 residual stream: a numerics change by design (Megatron's default under ``--bf16``),
  so within a stated tolerance: loss 2e-2 relative, every gradient's cosine to the plain one
  >= 0.99, and the stream really is bf16; all three together: every iteration's loss within
  2e-3 and gradient norm within 3e-2 (relative) of the plain path.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.graphs import make_capturable_adamw
from stalwart.loop import ComputeWeights, EagerPlan, GraphPlan, GuardedStep
from stalwart.models import GPT, GPTConfig
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
from graphs_fake_backend import FakeGraphContext  # type: ignore[import-not-found]
from poisoned_forward import PoisonedForward  # type: ignore[import-not-found]
from tiny_jobs import token_batches  # type: ignore[import-not-found]

ITERS, MICRO, EAGER_FOREVER = 3, 2, 10**6


def _config(**overrides: Any) -> GPTConfig:
    base: dict[str, Any] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64
    )
    return GPTConfig(**(base | overrides))


class Job:
    """A tiny GPT under ``GuardedStep`` with bf16 autocast; ``nan_call`` poisons one forward."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        weights: bool = False,
        in_graph: bool = False,
        nan_call: int = -1,
    ) -> None:
        torch.manual_seed(0)
        self.model = GPT(cfg)
        params = list(self.model.parameters())
        optimizer = make_capturable_adamw(params, lr=1e-2, device=torch.device("cpu"), fused=True)
        plan: EagerPlan | GraphPlan = EagerPlan()
        if in_graph:
            plan = GraphPlan(
                context=FakeGraphContext(), warmup_steps=EAGER_FOREVER, optimizer_in_graph=True
            )
        self.forward = PoisonedForward(nan_call)
        self.compute_weights = ComputeWeights(self.model) if weights else None
        self.machine = RerunConfig().build("cpu")
        self.step = GuardedStep(
            model=self.model, optimizer=optimizer, forward_step=self.forward,
            machine=self.machine, data=RerunDataIterator(token_batches(4 * ITERS * MICRO, cfg)),
            num_microbatches=MICRO, plan=plan, clip_grad=0.5, lookahead=False,
            autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
            compute_weights=self.compute_weights,
        )  # fmt: skip

    def train(self, *, exits: bool = False) -> list[Any]:
        torch.manual_seed(7)  # dropout draws start from the same state in every job
        results = []
        for it in range(ITERS):
            results.append(self.step.run(it + 1, launch_next=False))
            if results[-1].verdict.exit:
                break
        assert results[-1].verdict.exit == exits
        return results

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _assert_params(a: Job, b: Job, atol: float = 0.0) -> None:
    for (name, x), y in zip(a.model.named_parameters(), b.params(), strict=True):
        assert x.dtype == torch.float32
        if atol == 0.0:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=0.0, atol=atol, msg=name)


UNTIED_RECOMPUTE = dict(
    untie_embeddings_and_output_weights=True,
    dropout=0.1,
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
)
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
)


MOE = dict(num_experts=4, moe_router_topk=2, untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize(
    "overrides", [UNTIED_RECOMPUTE, LLAMA, MOE], ids=["untied-recompute", "llama", "moe"]
)
def test_bf16_compute_weights_equal_autocast_bitwise(overrides: dict[str, Any]) -> None:
    cfg = _config(**overrides)
    plain, copies = Job(cfg), Job(cfg, weights=True)
    seen: list[torch.dtype] = []  # the weight a Linear really ran on, forward and recompute
    first_linear = next(m for m in copies.model.modules() if isinstance(m, nn.Linear))
    first_linear.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    losses = [r.losses["lm loss"] for r in plain.train()]
    assert [r.losses["lm loss"] for r in copies.train()] == losses
    assert seen and set(seen) == {torch.bfloat16}
    _assert_params(copies, plain)
    assert copies.compute_weights is not None
    weights = copies.compute_weights
    assert [c.dtype for c in weights.copies] == weights.copy_dtypes
    assert set(weights.copy_dtypes) == {torch.bfloat16, torch.float32}
    # The norms' gradients join the one foreach add too (fp32 copies swapped in the same way).
    norms = {id(p) for m in copies.model.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)
             for p in m.parameters()}  # fmt: skip
    fp32_masters = {
        id(m) for m, d in zip(weights.masters, weights.copy_dtypes) if d == torch.float32
    }
    assert norms and norms <= fp32_masters
    # Outside a micro-batch the modules hold their fp32 parameters again.
    assert {p.dtype for p in copies.model.parameters()} == {torch.float32}
    assert copies.model.output_compute_weight is None


def test_bf16_compute_weights_tied_embeddings_within_1e6() -> None:
    cfg = _config()
    plain, copies = Job(cfg), Job(cfg, weights=True)
    plain.train(), copies.train()
    _assert_params(copies, plain, atol=1e-6)
    slots = [name for _, name, _ in copies.compute_weights.slots]  # type: ignore[union-attr]
    assert "output_compute_weight" in slots  # the output layer's use of the tied weight


def test_optimizer_in_graph_equals_eager_gated_step() -> None:
    cfg = _config(dropout=0.1)
    eager, graphed = Job(cfg), Job(cfg, in_graph=True)
    a, b = eager.train(), graphed.train()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.losses["lm loss"], y.losses["lm loss"])
        assert torch.allclose(x.grad_norm, y.grad_norm, rtol=1e-6, atol=0)
    _assert_params(graphed, eager)
    runner = graphed.step.runners.optimizer
    assert runner._in_pass  # the last iterations' steps were the graph's own, not eager ones


def test_optimizer_in_graph_skips_a_rejected_step_on_the_device() -> None:
    """Iteration 2's first forward is NaN while the graph holds the step: the device skips it,
    the rerun is clean (a transient fault: Megatron's exit 16), and the parameters are those
    after iteration 1, exactly as with the eager gated step."""
    cfg = _config()
    nan_call = 2 * MICRO  # iterations 0 and 1 ran clean: the step is in the graph by then
    eager, graphed = Job(cfg, nan_call=nan_call), Job(cfg, in_graph=True, nan_call=nan_call)
    a, b = eager.train(exits=True), graphed.train(exits=True)
    assert len(a) == len(b) == 3 and a[-1].verdict == b[-1].verdict
    assert (
        graphed.forward.calls == eager.forward.calls == 4 * MICRO
    )  # the rejected pass was run again
    assert graphed.step.runners.optimizer._in_pass is False  # the rerun's step was held
    _assert_params(graphed, eager)
    clean = Job(cfg, in_graph=True)
    clean.step.run(1, launch_next=False), clean.step.run(2, launch_next=False)
    _assert_params(graphed, clean)  # the rejected step touched nothing


def test_all_ingredients_eager_within_tolerance_of_plain() -> None:
    plain = Job(_config())
    every = Job(_config(bf16_residual_connection=True), weights=True, in_graph=True)
    a, b = plain.train(), every.train()
    # Adam turns the bf16 stream's tiny gradient differences into lr-sized steps, so the
    # parameters are not compared; the losses and norms of every iteration are.
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y.losses["lm loss"], x.losses["lm loss"], rtol=2e-3, atol=0)
        torch.testing.assert_close(y.grad_norm, x.grad_norm, rtol=3e-2, atol=0)


def test_bf16_residual_stream_within_tolerance() -> None:
    torch.manual_seed(0)
    plain = GPT(_config())
    bf16 = GPT(_config(bf16_residual_connection=True))
    bf16.load_state_dict(plain.state_dict())
    batch = token_batches(1, plain.config)[0]
    dtypes: list[torch.dtype] = []
    bf16.layers[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out[0].dtype))
    losses, grads = [], []
    for model in (plain, bf16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch["ids"], batch["labels"])["loss"]
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    assert dtypes == [torch.bfloat16]
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=0)
    for g_plain, g_bf16 in zip(*grads, strict=True):
        assert nn.functional.cosine_similarity(g_plain, g_bf16, dim=0) >= 0.99


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--bf16-compute-weights"], "--bf16-compute-weights needs --bf16"),
        (["--bf16-residual-connection"], "--bf16-residual-connection needs --bf16"),
        (["--cuda-graph-include-optimizer"], "--cuda-graph-include-optimizer needs --cuda-graph"),
    ],
)
def test_ingredient_flags_refuse_bad_combinations(flags: list[str], needle: str) -> None:
    argv = ["--preset", "tiny", *flags]
    with pytest.raises(ValueError, match="^" + needle):
        build_run_config(parse_train_args(argv), argv)


def test_ingredient_flags_reach_the_plan_and_model() -> None:
    argv = ["--preset", "tiny", "--bf16", "--bf16-compute-weights", "--bf16-residual-connection",
            "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph",
            "--cuda-graph-include-optimizer"]  # fmt: skip
    config = build_run_config(parse_train_args(argv), argv)
    plan = config.graphs.build()
    assert isinstance(plan, GraphPlan)
    assert plan.optimizer_in_graph and not plan.optimizer_graph  # one graph, not two
    assert config.model.bf16_residual_connection and config.training.bf16_compute_weights
    assert config.graphs.optimizer_captured  # the optimizer is built capturable


def test_compute_weights_docstring_example_runs() -> None:
    import doctest

    import stalwart.loop.compute_weights as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


SHAPE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2"]  # fmt: skip


def test_trainer_wires_the_flags_into_its_step() -> None:
    from stalwart.distributed.process_group import DistributedContext
    from stalwart.train import build
    from stalwart.train.trainer import Trainer

    argv = ["--preset", "tiny", *SHAPE, "--use-cpu", "--bf16", "--train-iters", "2",
            "--global-batch-size", "4", "--bf16-compute-weights",
            "--bf16-residual-connection", "--no-progress-bar"]  # fmt: skip
    config = build_run_config(parse_train_args(argv), argv)
    trainer = Trainer(config, DistributedContext())
    try:
        weights = trainer.step.runners.forward_backward.compute_weights
        assert isinstance(weights, ComputeWeights) and weights.dtype == torch.bfloat16
        assert trainer.raw_model.config.bf16_residual_connection
        result = trainer.step.run(1, launch_next=False)
        assert torch.isfinite(result.losses["lm loss"]) and weights.copies
        from stalwart.observability.memory import MemoryMonitor

        monitor = next(p for p in trainer.shell.log.providers if isinstance(p, MemoryMonitor))
        assert monitor.estimate is not None  # the theoretical report counts the copies
        copies = sum(c.numel() for c in weights.copies if c.dtype == torch.bfloat16)
        assert monitor.estimate.breakdown["compute_weight_copies"] == 2 * copies
        two_ranks = DistributedContext(world_size=2, backend="gloo")
        # DDP: the step reduces the gradients itself (tests/distributed/test_compute_weights_ddp);
        # FSDP2: refused, naming its own equivalent.
        assert build.build_compute_weights(config, trainer.raw_model, two_ranks) is not None
        fsdp2 = dataclasses.replace(
            config, training=dataclasses.replace(config.training, use_torch_fsdp2=True)
        )
        with pytest.raises(ValueError, match=r"--use-torch-fsdp2: .*MixedPrecisionPolicy"):
            build.build_compute_weights(fsdp2, trainer.raw_model, two_ranks)
    finally:
        trainer.close()


def test_first_micro_batch_copies_into_the_fp32_grads_except_a_tied_weight() -> None:
    """``accumulate(overwrite=True)`` writes a pass's first bf16 gradients over the fp32 ones
    (their old values are never read) but still adds into the tied embedding, whose lookup
    gradient autograd put there first; a weight shared by two Linears is added to as well."""
    torch.manual_seed(0)
    model = GPT(_config())
    weights = ComputeWeights(model)
    names = {id(p): n for n, p in model.named_parameters()}
    direct = [names[id(p)] for p, d in zip(weights.masters, weights.direct, strict=True) if d]
    assert direct == ["word_embeddings.weight"]
    batch = token_batches(1, model.config)[0]

    def first_micro_batch(stale: float, overwrite: bool) -> dict[str, torch.Tensor]:
        for p in model.parameters():
            p.grad = torch.full_like(p, stale)
        weights.refresh()
        with torch.autocast("cpu", dtype=torch.bfloat16), weights.using():
            model(batch["ids"], batch["labels"])["loss"].backward()
        weights.accumulate(overwrite=overwrite)
        return {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]

    added = first_micro_batch(0.0, overwrite=False)
    copied = first_micro_batch(7.0, overwrite=True)
    for name in {names[id(p)] for p in weights.masters}:
        if name == "word_embeddings.weight":
            torch.testing.assert_close(copied[name] - 7.0, added[name], rtol=0, atol=1e-5)
        else:
            assert torch.equal(copied[name], added[name]), name
    shared = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shared[1].weight = shared[0].weight
    assert ComputeWeights(shared).direct == [True, False, True, False]  # weight, bias, ...


def test_norm_and_position_grads_skip_autograd_accumulation() -> None:
    """With the fp32 copies of the norms and position embeddings only the word embeddings'
    lookup gradient is still added by autograd (``AccumulateGrad``): at most one add per
    micro-batch instead of one per norm weight, norm bias and position table."""
    from torch.profiler import ProfilerActivity, profile

    job = Job(_config(), weights=True)
    job.step.run(1, launch_next=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        job.step.run(2, launch_next=False)

    def under_accumulate_grad(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None and "AccumulateGrad" not in parent.name:
            parent = parent.cpu_parent
        return parent is not None

    adds = [e for e in prof.events() if e.name == "aten::add_" and under_accumulate_grad(e)]
    assert len(adds) <= MICRO  # the word embeddings only (5 norms x 2 + positions without)
