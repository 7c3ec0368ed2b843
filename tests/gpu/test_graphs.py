"""GPU tests of stalwart.graphs on the reference GPT (run on the device machine)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from stalwart.graphs import (
    FullIterationGraph,
    GraphContext,
    OptimizerGraph,
    StagePhase,
    make_capturable_adamw,
    set_learning_rate,
)
from stalwart.loop import EagerPlan, GraphPlan, GuardedStep
from stalwart.models import GPT, PRESET_MICRO_BATCH_SIZE, preset_model_config
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    yield
    torch.cuda.synchronize()


@pytest.fixture
def graph_context() -> Iterator[Callable[[], GraphContext]]:
    """New GraphContexts, each torn down when the test ends, failed or not: a failed assertion
    must not leave captured graphs alive (a graph and its context reference each other's owner
    until teardown; kept past the test, they were destroyed at interpreter shutdown)."""
    made: list[GraphContext] = []

    def new() -> GraphContext:
        made.append(GraphContext(torch.device("cuda")))
        return made[-1]

    try:
        yield new
    finally:
        for ctx in made:
            ctx.teardown()


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


# Llama-style cases: the llama-tiny preset (RoPE buffers, RMSNorm, SwiGLU, GQA, untied output)
# eagerly and with activation recompute inside the captured iteration (no dropout: graph rules).
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "selective": {"recompute_granularity": "selective"},
}


def _model(preset: str, seed: int = 1234, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(preset_model_config(preset, **overrides)).cuda()


def _batches(
    preset: str, count: int, seed: int = 7, seq: int | None = None, vocab: int | None = None
) -> list[dict]:
    """Random tokens; ``vocab`` draws them from the first ``vocab`` ids only, which a model
    learns within a few steps (uniform tokens over the whole vocabulary have nothing to learn)."""
    cfg = preset_model_config(preset)
    s = cfg.seq_length if seq is None else seq
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        high = cfg.vocab_size if vocab is None else vocab
        tokens = torch.randint(0, high, (PRESET_MICRO_BATCH_SIZE[preset], s + 1), generator=gen)
        out.append({"input_ids": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda()})
    return out


class DeviceFlags:
    """A bare in-graph check (the mechanism: any object with a device-only ``reset_``): a
    running sum of the losses, non-finite when a check failed, and the skip gate from it."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        del names
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def reset_(self) -> None:
        self.total.zero_()

    def record_nonfinite(self, name: str, value: torch.Tensor) -> None:
        del name
        self.total.add_(value.detach().float())

    def update_skip_gate_(self, gate: torch.Tensor) -> None:
        gate.copy_(~torch.isfinite(self.total))

    def ok(self) -> bool:
        return bool(torch.isfinite(self.total))  # the one per-iteration validation read


class Poison:
    """A static device scalar added to the loss: 0 normally, NaN to inject a fault in the graph."""

    def __init__(self) -> None:
        self.value = torch.zeros((), device="cuda")


def make_forward_step(flags: DeviceFlags | None = None, poison: Poison | None = None) -> Any:
    def forward_step(data_iterator: Iterator[dict], model: GPT) -> tuple[torch.Tensor, dict]:
        batch = next(data_iterator)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch["input_ids"], batch["labels"])
        loss = out["loss"] if poison is None else out["loss"] + poison.value
        if flags is not None:
            flags.record_nonfinite("loss", loss)  # device-side: captured with the rest
        return loss, {"lm loss": out["lm loss"]}

    return forward_step


def forward_backward(
    *,
    forward_step_func: Any,
    data_iterator: Iterator[dict],
    model: GPT,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Minimal no-pipelining schedule with the Megatron forward_backward_func signature."""
    losses = []
    for _ in range(num_microbatches):
        loss, loss_dict = forward_step_func(data_iterator, model)
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append(loss_dict)
    return losses


def _call(fb: Any, model: GPT, batches: list[dict], step: Any, seq: int | None = None) -> Any:
    cfg = model.config
    return fb(
        forward_step_func=step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=cfg.seq_length if seq is None else seq,
        micro_batch_size=batches[0]["input_ids"].shape[0],
    )


def _max_diff(model: GPT, ref: list[torch.Tensor]) -> float:
    return max((_grad(p) - r).abs().max().item() for p, r in zip(model.parameters(), ref))


def _eager_grads(preset: str, batches: list[dict], **overrides: Any) -> list[torch.Tensor]:
    model = _model(preset, **overrides)
    _call(forward_backward, model, batches, make_forward_step())
    return [_grad(p).detach().clone() for p in model.parameters()]


# Eager runs that measure eager's own spread: the graph is held to what eager itself varies by.
EAGER_REPEATS = 4


@pytest.fixture
def deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for one test, restored after.

    Why: with torch's default algorithms eager itself is not deterministic on the H100 at
    ``small``: two eager runs of the same step differed by 3.8e-6 in one run of the suite and
    agreed bitwise in another, where the graph then differed by 3.8e-6 against a bound of
    3.1e-8 built on that measured 0. The likely source is flash attention's default backward
    (bf16 autocast), which adds dQ up with atomics. Deterministic algorithms take its
    deterministic backward, and torch raises for any op that has no deterministic kernel rather
    than letting one through; cuBLAS is deterministic per stream with torch's per-stream
    workspaces, and torch's check wants ``CUBLAS_WORKSPACE_CONFIG`` to say so.
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setenv(
        "CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


@pytest.mark.parametrize(
    ("preset", "recompute"),
    [
        ("tiny", "none"),
        ("small", "none"),
        ("llama-tiny", "none"),
        ("llama-tiny", "full"),
        ("llama-tiny", "selective"),
    ],
)
@pytest.mark.usefixtures("deterministic_algorithms")
def test_step0_gradients_match_eager(
    preset: str, recompute: str, graph_context: Callable[[], GraphContext]
) -> None:
    overrides = RECOMPUTE[recompute]
    batches = _batches(preset, NUM_MICROBATCHES)
    eager_a = _eager_grads(preset, batches, **overrides)
    # Eager's spread: the largest difference of any repeat from the first (0 when eager is
    # deterministic, as it must be here; measured rather than assumed).
    repeats = [_eager_grads(preset, batches, **overrides) for _ in range(EAGER_REPEATS - 1)]
    if recompute != "none":  # recompute is the same computation: compare with plain eager too
        repeats.append(_eager_grads(preset, batches))
    spread = max(_max_abs_diff(eager_a, other) for other in repeats)
    model = _model(preset, **overrides)
    graph = FullIterationGraph(
        forward_backward, context=graph_context(), warmup_steps=2, grad_params=model.parameters()
    )
    step = make_forward_step()
    warm_diff = 0.0
    for i in range(4):  # 2 eager warm-ups (capture stream), capture + replay, replay
        losses = _call(graph, model, batches, step)
        if i == 1:
            warm_diff = _max_diff(model, eager_a)
    assert graph.phase() is StagePhase.CAPTURED
    diff = _max_diff(model, eager_a)
    scale = max(g.abs().max().item() for g in eager_a)
    print(
        f"{preset} recompute={recompute}: eager-vs-eager {spread:.3e} over {len(repeats) + 1} "
        f"runs, eager-on-capture-stream {warm_diff:.3e}, graph-vs-eager {diff:.3e} "
        f"(max |grad| {scale:.3e})"
    )
    if preset in ("tiny", "llama-tiny") and spread == 0.0:
        assert diff == 0.0, f"graphed step-0 grads differ from deterministic eager by {diff}"
    else:
        # Measured on H200 at small (default algorithms): graph-vs-eager 5.7e-10 in one run and
        # 8.2e-9 in another (|grad| ~3e-2), and eager on the capture stream differs from eager
        # on the default stream by the same order (kernel selection per stream): the bound is
        # what eager itself varies by (repeats, the capture stream), with fp32 rounding of the
        # largest gradient as its floor.
        assert diff <= max(2 * spread, 2 * warm_diff, 1e-6 * scale)
    assert all(torch.isfinite(d["lm loss"]) for d in losses)


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _train(
    preset: str, graphed: bool, steps: int, lrs: list[float], **overrides: Any
) -> list[float]:
    model = _model(preset, **overrides)
    params = list(model.parameters())
    opt = make_capturable_adamw(params, lr=lrs[0], device=torch.device("cuda"))
    data = _batches(preset, steps * NUM_MICROBATCHES, seed=11, vocab=64)  # learnable: loss falls
    step = make_forward_step()
    losses: list[torch.Tensor] = []
    ctx = GraphContext(torch.device("cuda")) if graphed else None
    try:
        if ctx is not None:
            fb: Any = FullIterationGraph(
                forward_backward, context=ctx, warmup_steps=2, grad_params=params
            )
            opt_graph = OptimizerGraph(opt, context=ctx, clip_grad=1.0)
        for i in range(steps):
            batch = data[i * NUM_MICROBATCHES : (i + 1) * NUM_MICROBATCHES]
            if ctx is None:
                opt.zero_grad(set_to_none=False)
                out = _call(forward_backward, model, batch, step)
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                set_learning_rate(opt, lrs[i])
                opt.step()
            else:
                out = _call(fb, model, batch, step)
                opt_graph.step(lr=lrs[i])
            losses.append(torch.stack([d["lm loss"] for d in out]).mean().clone())
    finally:
        if ctx is not None:
            ctx.teardown()
    return [v.item() for v in losses]


@pytest.mark.parametrize(
    ("preset", "recompute"), [("tiny", "none"), ("llama-tiny", "none"), ("llama-tiny", "full")]
)
def test_loss_trajectory_within_eager_spread(preset: str, recompute: str) -> None:
    steps = 20
    lrs = [1e-3 * min(1.0, (i + 1) / 5) for i in range(steps)]  # warm-up schedule
    overrides = RECOMPUTE[recompute]
    eager_a = _train(preset, False, steps, lrs, **overrides)
    eager_b = _train(preset, False, steps, lrs, **overrides)
    graphed = _train(preset, True, steps, lrs, **overrides)
    spread = max(abs(a - b) for a, b in zip(eager_a, eager_b))
    tol = max(2 * spread, 1e-3)
    worst = max(abs(g - a) for g, a in zip(graphed, eager_a))
    print(
        f"{preset} recompute={recompute} trajectory: eager spread {spread:.3e}, graph worst {worst:.3e}, losses {graphed[::5]}"
    )
    assert worst <= tol
    assert graphed[-1] < graphed[0]


def test_injected_nan_in_graph_is_caught_and_optimizer_skipped(
    graph_context: Callable[[], GraphContext],
) -> None:
    model = _model("tiny")
    params = list(model.parameters())
    opt = make_capturable_adamw(params, lr=1e-3, device=torch.device("cuda"))
    flags, poison = DeviceFlags(["loss"], torch.device("cuda")), Poison()
    ctx = graph_context()
    fb = FullIterationGraph(
        forward_backward, context=ctx, warmup_steps=1, grad_params=params, validation_buffer=flags
    )
    opt_graph = OptimizerGraph(opt, context=ctx, clip_grad=1.0)
    step = make_forward_step(flags, poison)
    data = _batches("tiny", 6 * NUM_MICROBATCHES, seed=3)
    skipped = []
    for i in range(6):
        poison.value.fill_(float("nan") if i == 4 else 0.0)
        before = [p.detach().clone() for p in params]
        _call(fb, model, data[i * NUM_MICROBATCHES : (i + 1) * NUM_MICROBATCHES], step)
        if flags.ok():
            opt_graph.step(lr=1e-3)
        else:
            skipped.append(i)
            assert fb.phase() is StagePhase.CAPTURED  # caught inside the replayed graph
            assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert skipped == [4]
    assert all(torch.isfinite(p).all() for p in params)
    assert opt_graph.phase is StagePhase.CAPTURED


def test_lr_schedule_under_optimizer_graph_matches_eager(
    graph_context: Callable[[], GraphContext],
) -> None:
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(64, 64, device="cuda")) for _ in range(3)]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    grads = [[torch.randn(64, 64, device="cuda") for _ in ref] for _ in range(10)]
    lrs = [0.1 * (0.7**i) for i in range(10)]
    ref_opt = torch.optim.AdamW(ref, lr=lrs[0], foreach=True)
    ctx = graph_context()
    opt_graph = OptimizerGraph(
        make_capturable_adamw(ours, lr=lrs[0], device=torch.device("cuda")),
        context=ctx,
        clip_grad=5.0,
    )
    for p in ours:
        p.grad = torch.zeros_like(p)
    for i in range(10):
        for p, q, g in zip(ref, ours, grads[i]):
            p.grad = g.clone()
            _grad(q).copy_(g)  # fixed .grad addresses for the graph
        torch.nn.utils.clip_grad_norm_(ref, 5.0, foreach=True)
        for group in ref_opt.param_groups:
            group["lr"] = lrs[i]
        ref_opt.step()
        opt_graph.step(lr=lrs[i])
    assert opt_graph.phase is StagePhase.CAPTURED
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)


def test_recapture_on_shape_change(graph_context: Callable[[], GraphContext]) -> None:
    model = _model("tiny")
    ctx = graph_context()
    fb = FullIterationGraph(
        forward_backward, context=ctx, warmup_steps=1, grad_params=model.parameters()
    )
    step = make_forward_step()
    long_batches = _batches("tiny", 2)
    short_batches = _batches("tiny", 2, seq=128)
    _call(fb, model, long_batches, step)
    _call(fb, model, long_batches, step)
    assert fb.phase() is StagePhase.CAPTURED
    with pytest.warns(UserWarning, match="workload changed .*seq_length"):
        eager_short = _call(fb, model, short_batches, step, seq=128)
    assert fb.phase() is StagePhase.WARMUP
    eager_loss = [d["lm loss"].clone() for d in eager_short]
    graphed = _call(fb, model, short_batches, step, seq=128)
    assert fb.phase() is StagePhase.CAPTURED and fb.num_captures == 2
    for g, e in zip(graphed, eager_loss):
        torch.testing.assert_close(g["lm loss"], e)


def _gated_run(overlapped: bool, poison_at: int, steps: int = 7) -> tuple[list, list, Any]:
    """Fused AdamW behind a device skip gate: overlapped gated replays vs host-decided steps."""
    model = _model("tiny")
    params = list(model.parameters())
    device = torch.device("cuda")
    opt = make_capturable_adamw(params, lr=1e-3, device=device, fused=True)
    flags, poison = DeviceFlags(["loss"], device), Poison()
    gate = torch.zeros((), dtype=torch.float32, device=device)

    def gated_fb(**kwargs: Any) -> Any:
        out = forward_backward(**kwargs)
        flags.update_skip_gate_(gate)  # inside the graph: the device decides
        return out

    ctx = GraphContext(device)
    try:
        fb = FullIterationGraph(
            gated_fb, context=ctx, warmup_steps=1, grad_params=params, validation_buffer=flags
        )
        opt_graph = OptimizerGraph(opt, context=ctx, clip_grad=1.0, skip_gate=gate)
        step = make_forward_step(flags, poison)
        data = _batches("tiny", steps * NUM_MICROBATCHES, seed=5)
        skipped, snapshots = [], []
        for i in range(steps):
            poison.value.fill_(float("nan") if i == poison_at else 0.0)
            _call(fb, model, data[i * NUM_MICROBATCHES : (i + 1) * NUM_MICROBATCHES], step)
            if overlapped:
                opt_graph.step(lr=1e-3, gated=True, overlap=True)
                ok = flags.ok()  # overlaps the optimizer replay on the second stream
                opt_graph.join()
            else:
                ok = flags.ok()
                if ok:
                    opt_graph.step(lr=1e-3)
            if not ok:
                skipped.append(i)
            snapshots.append([p.detach().clone() for p in params])
        assert fb.phase() is StagePhase.CAPTURED and opt_graph.phase is StagePhase.CAPTURED
        counters = [s["step"].item() for s in opt.state.values()]
    finally:
        ctx.teardown()
    return skipped, snapshots, counters


def test_gated_overlapped_optimizer_skips_on_device_and_matches_host_decided() -> None:
    poison_at = 5  # after warm-up (2 eager) and capture: the rejected step is a replay
    skipped, overlapped, counters = _gated_run(True, poison_at)
    ref_skipped, host, ref_counters = _gated_run(False, poison_at)
    assert skipped == ref_skipped == [poison_at]
    for a, b in zip(overlapped[poison_at - 1], overlapped[poison_at]):
        assert torch.equal(a, b)  # the rejected replay left the parameters untouched
    for step_a, step_b in zip(overlapped, host):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b))
    assert counters == ref_counters and set(counters) == {6.0}


def _guarded(
    graphed: bool,
    lookahead: bool,
    poison_call: int,
    iters: int = 8,
    rerun: RerunConfig | None = None,
) -> tuple:
    """``GuardedStep`` on the tiny GPT: eager (fused AdamW) or graphed, NaN at one forward
    (``rerun``: the machine's flags, default ``RerunConfig()``)."""
    model = _model("tiny")
    device = torch.device("cuda")
    params = list(model.parameters())
    if graphed:
        optimizer = make_capturable_adamw(params, lr=1e-3, device=device, fused=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    calls = [0]

    def forward_step(batch: dict, m: GPT) -> dict:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(batch["input_ids"], batch["labels"])
        if calls[0] == poison_call:  # eager: one forward; graphed: a warm-up pass
            out = {**out, "loss": out["loss"] * float("nan")}
        calls[0] += 1
        return out

    step = GuardedStep(
        model=model, optimizer=optimizer, forward_step=forward_step,
        machine=(rerun or RerunConfig()).build(device),
        data=RerunDataIterator(_batches("tiny", (iters + 2) * NUM_MICROBATCHES, seed=5)),
        num_microbatches=NUM_MICROBATCHES, plan=GraphPlan() if graphed else EagerPlan(),
        clip_grad=1.0, lookahead=lookahead,
    )  # fmt: skip
    results = []
    for it in range(iters):
        results.append(step.run(it + 1, launch_next=it + 1 < iters))
        if results[-1].verdict.exit:
            break
    torch.cuda.synchronize()
    out = ([p.detach().clone() for p in params], results, step.num_used)
    step.close()
    return out


@pytest.mark.parametrize("graphed", [False, True])
def test_guarded_step_lookahead_is_exact_on_the_device(graphed: bool) -> None:
    """The look-ahead (next iteration launched before the read) changes nothing, bitwise: the
    eager gated step (fused AdamW reading the machine's gate) and the graphed one."""
    ahead, ahead_results, used = _guarded(graphed, True, poison_call=-1)
    plain, plain_results, _ = _guarded(graphed, False, poison_call=-1)
    assert used > 0
    assert all(torch.equal(a, b) for a, b in zip(ahead, plain, strict=True))
    for a, b in zip(ahead_results, plain_results, strict=True):
        assert torch.equal(a.losses["lm loss"], b.losses["lm loss"])
        assert torch.equal(a.grad_norm, b.grad_norm)


def test_guarded_step_eager_fault_after_a_launch_reruns_and_exits_17_like_without() -> None:
    """A transient NaN in iteration 4's first micro-batch (run ahead during iteration 3): the
    gated step skipped itself, the rerun is clean, exit 17, parameters equal without launch."""
    poison = 3 * NUM_MICROBATCHES
    ahead, ahead_results, _ = _guarded(False, True, poison_call=poison)
    plain, plain_results, _ = _guarded(False, False, poison_call=poison)
    assert ahead_results[-1].verdict.exit_code == plain_results[-1].verdict.exit_code == 17
    assert len(ahead_results) == len(plain_results) == 4
    assert all(torch.equal(a, b) for a, b in zip(ahead, plain, strict=True))


@pytest.mark.parametrize("graphed", [False, True])
def test_a_transient_under_continue_costs_one_replay_and_ends_bitwise_on_the_device(
    graphed: bool,
) -> None:
    """``--rerun-transient-policy continue``: a transient injected on the device into
    iteration 6's first check (graphed: a replay of the captured pass) is rerun, the rerun's
    result is applied (its step host-decided, or the optimizer graph replayed ungated) and the
    parameters equal the fault-free run's bitwise."""
    rerun = RerunConfig(
        error_injection_rate=1,
        error_injection_type="transient_error",
        error_injection_iterations=[6],
        rerun_transient_policy="continue",
    )
    faulty, results, _ = _guarded(graphed, True, poison_call=-1, rerun=rerun)
    clean, _, _ = _guarded(graphed, True, poison_call=-1)
    assert len(results) == 8 and not any(r.verdict.exit for r in results)
    assert all(torch.equal(a, b) for a, b in zip(faulty, clean, strict=True))
