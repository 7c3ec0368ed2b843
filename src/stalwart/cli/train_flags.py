"""``stalwart train`` flags of the run itself: model, data, training, optimizer, checkpoints.

Each group is a component; its ``table`` is the TOML table that ``--print-config`` writes its
flags under (``--config`` ignores tables, so any layout of the same keys reads the same). Help is
one sentence: `stalwart.cli.help_format.FlagHelpFormatter` appends the default and the choices.
Flags whose default depends on the preset default to None ("unset") and say what unset means.
"""

from __future__ import annotations

import argparse
from typing import Any

from stalwart.cli.arg_types import Float, Int
from stalwart.config.checks import SEED_MAX
from stalwart.config.training import LRDecayStyle

PRESET_NAMES = ("tiny", "small", "gpt2-124m", "llama-tiny", "llama-150m")
_PRESET = "(default: the preset's)"


def group(p: argparse.ArgumentParser, table: str, title: str) -> Any:
    """An argument group whose flags ``--print-config`` writes under ``[table]``."""
    g = p.add_argument_group(title)
    g.toml_table = table  # type: ignore[attr-defined]
    return g


def switch(g: Any, flag: str, help: str) -> None:
    """A flag that is off unless given (``store_true``)."""
    g.add_argument(flag, action="store_true", help=help)


def model_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "model", "model")
    g.add_argument(
        "--preset", choices=PRESET_NAMES, default="tiny", metavar="NAME", help="model size preset"
    )
    g.add_argument("--num-layers", type=int, help=f"transformer layers {_PRESET}")
    g.add_argument("--hidden-size", type=int, help=f"model width {_PRESET}")
    g.add_argument("--num-attention-heads", type=int, help=f"attention heads {_PRESET}")
    g.add_argument("--seq-length", type=int, help=f"tokens per sample {_PRESET}")
    g.add_argument(
        "--ffn-hidden-size", type=int, help="MLP width (default: the preset's, else 4 x hidden)"
    )
    g.add_argument("--vocab-size", type=int, help=f"vocabulary size {_PRESET}")
    g.add_argument(
        "--hidden-dropout",
        type=float,
        help="dropout everywhere: embeddings, attention, residuals (default: 0.0)",
    )
    g.add_argument(
        "--num-experts",
        type=Int(1),
        help="MoE experts per layer, >= 1 (default: none, a dense MLP; Megatron's meaning)",
    )
    g.add_argument("--moe-router-topk", type=int, help="experts per token (default: 2)")
    g.add_argument(
        "--moe-aux-loss-coeff", type=float, help="load-balancing loss weight (default: 0.01)"
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        "--moe-capacity-factor",
        dest="moe_capacity_factor",
        type=Float(gt=0),
        help="per-expert capacity; tokens beyond it are dropped (default: 1.25)",
    )
    g.add_argument(
        "--init-method-std", type=Float(gt=0), help="std of the weight init (default: 0.02)"
    )
    _megatron_model_flags(g)


def _megatron_model_flags(g: Any) -> None:
    """Megatron's flags whose value stalwart's model derives from others: accepted when they
    agree (checked by ``stalwart.config.model.check_megatron_model_flags``), refused otherwise."""
    g.add_argument(
        "--max-position-embeddings",
        type=Int(1),
        help=">= --seq-length; = --seq-length with learned positions (default: unset)",
    )
    g.add_argument(
        "--kv-channels",
        type=Int(1),
        help="= --hidden-size / --num-attention-heads (default: unset)",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        help="= --hidden-dropout, the one dropout (default: unset)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=Int(1),
        help="--vocab-size must be a multiple: no padding (default: unset)",
    )


def architecture_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's Llama switches; unset flags keep the preset's value (llama-* presets set them)."""
    g = group(p, "model.architecture", "model: architecture (GPT-2 unless a llama-* preset)")
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        metavar="KIND",
        help=f"learned absolute positions (GPT-2) or rotary embeddings (Llama) {_PRESET}",
    )
    g.add_argument("--rotary-base", type=int, help="RoPE base, rope only (default: 10000)")
    g.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        metavar="KIND",
        help=f"norm of every layer {_PRESET}",
    )
    g.add_argument("--norm-epsilon", type=Float(gt=0), help="epsilon of every norm (default: 1e-5)")
    for flag, text in (
        ("--swiglu", "SwiGLU MLP (3 matrices) instead of GELU"),
        ("--untie-embeddings-and-output-weights", "an output layer of its own, not the embedding"),
        ("--disable-bias-linear", "no biases in attention/MLP linear layers"),
        ("--group-query-attention", "GQA with --num-query-groups K/V heads"),
    ):
        g.add_argument(flag, action="store_true", default=None, help=f"{text} {_PRESET}")
    g.add_argument(
        "--num-query-groups",
        type=int,
        help="K/V heads with GQA; divides the heads (default: the preset's, else 1)",
    )


def recompute_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "model.recompute", "model: activation recompute")
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        metavar="KIND",
        help="selective: the attention core; full: whole layers (with --recompute-method and "
        "--recompute-num-layers) (default: off)",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        metavar="KIND",
        help="full: uniform groups of --recompute-num-layers, or block: the first ones",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        help="full: layers per group (uniform) or recomputed (block)",
    )


def data_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "data", "data")
    g.add_argument(
        "--data-path",
        nargs="+",
        metavar="PATH",
        help="file.txt (bytes) or file.bin (token ids); several blend equally, 'w1 p1 w2 p2' by "
        "weight (default: the embedded corpus)",
    )
    g.add_argument(
        "--data-dtype",
        default="uint16",
        choices=("uint16", "uint32"),
        metavar="DTYPE",
        help="dtype of the token ids of a .bin file",
    )
    g.add_argument("--valid-fraction", type=float, default=0.02, help="held-out share of the data")
    g.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="read samples in order instead of a seeded shuffle",
    )
    g.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader read-ahead processes (default: 0 = read in the loop)",
    )


def _compile_flags(g: Any) -> None:
    switch(g, "--compile", "torch.compile the model (inductor)")
    g.add_argument(
        "--inductor-config",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="with --compile: an Inductor option of the model's torch.compile (repeatable; a "
        "Python literal of the option's type, e.g. triton.mix_order_reduction=False)",
    )
    g.add_argument(
        "--compile-cache-dir",
        default=None,
        metavar="DIR",
        help="with --compile: torch's persistent compile caches, so that a relaunch does not "
        "compile again (default: <run dir>/compile_cache; must be yours and writable by you "
        "only: it holds code the run executes)",
    )


def _precision_flags(g: Any) -> None:
    switch(g, "--bf16", "bfloat16 mixed precision")
    switch(g, "--fp16", "float16 with dynamic loss scaling")
    switch(
        g,
        "--bf16-compute-weights",
        "with --bf16: Linear layers run on bf16 copies of the fp32 weights made once per "
        "iteration (not autocast casts per micro-batch); their grads are added into the fp32 "
        "grads after each micro-batch (one rank or DDP; not with --use-torch-fsdp2)",
    )
    switch(
        g,
        "--gradient-accumulation-fusion",
        "with --bf16-compute-weights: the weight-gradient GEMMs add into the fp32 grads "
        "(fp32 output on CUDA) and the embedding lookup adds its rows into them, instead of a "
        "bf16 grad per micro-batch and an add (Megatron's flag)",
    )
    switch(
        g,
        "--bf16-residual-connection",
        "with --bf16: keep the residual stream in bf16 instead of fp32 (Megatron's "
        "default under bf16, whose fp32 residual option is this switch off)",
    )
    switch(
        g,
        "--cross-entropy-loss-fusion",
        "the output layer and the cross entropy as one op whose forward writes the loss's "
        "gradient over the logits in place (one pass over the [tokens, vocab] logits less, no "
        "second tensor of that size; a Triton kernel on CUDA); Megatron's flag",
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16, help="fp16 starting scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16 scale floor")
    g.add_argument(
        "--loss-scale-window", type=int, default=1000, help="fp16: clean iterations to grow"
    )
    g.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows before shrinking")


def training_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "training", "training")
    g.add_argument(
        "--micro-batch-size", type=int, help="samples per rank per forward-backward (default: 8)"
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        help="samples per iteration (default: micro batch x data-parallel ranks)",
    )
    g.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCR", "SAMPLES"),
        help="grow the global batch from START by INCR over SAMPLES samples (default: off)",
    )
    # None here, 100 in build_run_config: --train-samples must know whether it was given.
    g.add_argument("--train-iters", type=int, help="iterations to train in total (default: 100)")
    g.add_argument(
        "--train-samples",
        type=int,
        help="train this many samples instead; the LR schedule then counts samples",
    )
    g.add_argument("--seed", type=Int(0, SEED_MAX), default=1234, help="seed of init and data")
    _precision_flags(g)
    g.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        help="evaluate every N iterations (default: 0 = never)",
    )
    g.add_argument("--eval-iters", type=int, default=10, help="batches per evaluation")
    switch(g, "--use-cpu", "train on CPU even if CUDA is present")
    switch(g, "--use-torch-fsdp2", "shard with FSDP2, not DDP")
    _compile_flags(g)
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="timeout of a collective before the job fails",
    )
    switch(g, "--manual-gc", "Python GC only at the same iterations on every rank")
    g.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="--manual-gc every N iterations (default: 0 = around eval only)",
    )
    g.add_argument(
        "--no-manual-gc-eval",
        dest="manual_gc_eval",
        action="store_false",
        help="--manual-gc: not around evaluation",
    )


def optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "optimizer", "optimizer and learning-rate schedule (AdamW)")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument(
        "--clip-grad", type=float, default=1.0, help="gradient norm clip (default: 1.0; 0 = off)"
    )
    switch(
        g,
        "--clip-grad-in-optimizer",
        "apply the --clip-grad factor inside the fused AdamW step (its grad_scale) instead "
        "of a separate pass over the gradients; the same norm, parameters equal to float32 "
        "rounding (one rank or DDP; not with --use-torch-fsdp2)",
    )
    g.add_argument(
        "--lr-decay-style",
        default=LRDecayStyle.COSINE.value,
        choices=tuple(s.value for s in LRDecayStyle),
        metavar="STYLE",
        help="decay shape",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up iterations")
    g.add_argument("--lr-decay-iters", type=int, help="decay ends here (default: --train-iters)")
    g.add_argument(
        "--lr-warmup-samples", type=int, default=0, help="warm-up samples (--train-samples)"
    )
    g.add_argument(
        "--lr-decay-samples",
        type=int,
        help="decay ends here, in samples (default: --train-samples)",
    )
    switch(
        g,
        "--override-opt-param-scheduler",
        "resume: use this run's LR schedule over the checkpoint's",
    )
    switch(
        g,
        "--use-checkpoint-opt-param-scheduler",
        "resume: keep the checkpoint's LR schedule over this run's",
    )


def checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "checkpoints", "checkpoints")
    g.add_argument("--save", metavar="DIR", help="checkpoint (and run) directory (default: none)")
    g.add_argument("--load", metavar="DIR", help="resume from here (default: --save)")
    g.add_argument(
        "--save-interval", type=int, default=0, help="save every N iterations (default: 0 = off)"
    )
    switch(g, "--no-load-optim", "resume without optimizer state")
    switch(g, "--no-load-rng", "resume without the RNG states")
    switch(g, "--finetune", "load weights only and start at iteration 0")
    g.add_argument(
        "--ckpt-keep-last",
        type=int,
        help="keep the last N checkpoints this job wrote (default: all)",
    )
    switch(g, "--ckpt-fallback", "newest checkpoint unusable: warn, load the newest usable one")
    switch(
        g,
        "--verify-checkpoint-on-load",
        "check every file of the checkpoint against its checksums before loading",
    )
    switch(g, "--async-save", "write checkpoints in the background")
    g.add_argument(
        "--non-persistent-save-interval",
        type=int,
        default=0,
        help="also save locally every N iterations (default: 0 = off)",
    )
    g.add_argument(
        "--non-persistent-ckpt-dir",
        metavar="DIR",
        help="fast local checkpoints (default: <save>/non_persistent)",
    )
