"""The stalwart and Hugging Face peers of ``bench/peers.py`` (each runs in its own child).

stalwart runs as ``stalwart train`` does (the CLI's ``main``, in the child's process); the clock
reads each completed iteration from ``Trainer._after_iteration`` (wrapped in this child only:
the bench's instrument, nothing of the run changes). The Hugging Face ``Trainer`` runs
``LlamaForCausalLM`` built from the same ``GPTConfig`` (``stalwart.models.hf_export``'s config:
the same function), timed from a ``TrainerCallback``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from peer_common import Clock, Spec, TokenWindows, model_config

# Compiled full-iteration graphs (the fast path: every same-numerics speed-up on) and every
# check: the defaults (NaN/Inf in the loss and gradients) and the two opt-in ones.
GRAPHS = ["--compile", "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"]
ALL_CHECKS = ["--check-for-spiky-loss", "--check-for-large-grads"]


def stalwart_flags(spec: Spec, run_dir: Path, extra: list[str], profile: bool) -> list[str]:
    """``stalwart train`` flags for ``spec`` (its profiler over the profiled iterations)."""
    n = str
    flags = [
        *spec.model_flags,
        "--micro-batch-size",
        n(spec.micro_batch_size),
        "--global-batch-size",
        n(spec.global_batch_size),
        "--train-iters",
        n(spec.total_iterations),
        "--seed",
        n(spec.seed),
        "--lr",
        n(spec.lr),
        "--data-path",
        spec.tokens_path,
        "--data-dtype",
        "uint32",
        "--eval-interval",
        "0",
        "--log-interval",
        n(spec.log_interval),
        "--log-throughput",
        "--no-progress-bar",
        "--run-dir",
        str(run_dir),
        *ALL_CHECKS,
    ]
    if spec.device == "cuda":
        flags += ["--bf16", *(GRAPHS if spec.compile else [])]
    else:
        flags += ["--use-cpu"]
    if profile:
        start, end = spec.timed_end, spec.timed_end + spec.profile_iters
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", n(start)]
        flags += ["--profile-step-end", n(end), "--profile-dir", str(run_dir / "profile")]
    return flags + extra


def _run_stalwart(spec: Spec, clock: Clock, peer: str, extra: list[str]) -> dict[str, Any]:
    from stalwart.cli.main import main
    from stalwart.train.trainer import Trainer

    run_dir = Path(spec.work_dir) / "stalwart-run" / ("-".join(extra) or "default")
    flags = stalwart_flags(spec, run_dir, extra, spec.profiles(peer))
    original = Trainer._after_iteration

    def timed(self: Trainer, result: Any) -> None:
        original(self, result)
        clock.after(self.state.iteration)

    Trainer._after_iteration = timed  # type: ignore[method-assign]
    print("stalwart train " + " ".join(flags), flush=True)
    code = main(["train", *flags])
    if code != 0:
        raise RuntimeError(f"stalwart train exited {code}")
    start, end = spec.timed_end, spec.timed_end + spec.profile_iters
    trace = run_dir / "profile" / f"trace_rank0_iters{start + 1}-{end}.json"
    return {
        "mode": "stalwart train " + " ".join(flags[len(spec.model_flags) :]),
        "trace": str(trace),
    }


def run_stalwart(spec: Spec, clock: Clock) -> dict[str, Any]:
    """Compiled full-iteration graphs (the same numerics as eager), every check on."""
    return _run_stalwart(spec, clock, "stalwart", [])


def run_stalwart_bf16_residual(spec: Spec, clock: Clock) -> dict[str, Any]:
    """... and the numerics switch: the residual stream in bf16."""
    extra = ["--bf16-residual-connection"] if spec.device == "cuda" else []
    return _run_stalwart(spec, clock, "stalwart-bf16-residual", extra)


def run_hf(spec: Spec, clock: Clock) -> dict[str, Any]:
    """The Hugging Face Trainer on ``LlamaForCausalLM`` (sdpa, bf16 autocast over fp32 weights,
    ``torch_compile``, fused AdamW), the same shape, batch and tokens."""
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback

    from stalwart.models.hf_export import hf_llama_config

    cfg = model_config(spec)
    cuda = spec.device == "cuda"
    torch.manual_seed(spec.seed)
    with torch.device(spec.device):  # initialised where it trains (as torchtitan does)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**hf_llama_config(cfg)), attn_implementation="sdpa"
        )
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-", dir=spec.work_dir),
        per_device_train_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=spec.num_microbatches,
        max_steps=spec.total_iterations,
        learning_rate=spec.lr,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        bf16=cuda,
        torch_compile=spec.compile,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        logging_steps=spec.log_interval,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec.seed,
        use_cpu=not cuda,
        dataloader_drop_last=True,
    )

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.before(state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.after(state.global_step)

    dataset = TokenWindows(spec.tokens_path, cfg.seq_length)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=dataset, callbacks=[Timing()]
    )
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    attention = getattr(model.config, "_attn_implementation", None)
    return {
        "mode": f"transformers {transformers.__version__} Trainer, LlamaForCausalLM "
        f"({attention}), bf16={cuda}, torch_compile={spec.compile}, "
        f"{getattr(args.optim, 'value', args.optim)}",
        "last_logged_loss": losses[-1] if losses else None,
    }
