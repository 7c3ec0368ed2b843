"""``stalwart train`` flags of the run itself: model, data, training, optimizer, checkpoints.

Each group is a component; its ``table`` is the TOML table that ``--print-config`` writes its
flags under (``--config`` ignores tables, so any layout of the same keys reads the same). Help is
one sentence: `stalwart.cli.help_format.FlagHelpFormatter` appends the default and the choices.
Flags whose default depends on the preset default to None ("unset") and say what unset means.
"""

from __future__ import annotations

import argparse
from typing import Any

from stalwart.checkpoint.non_persistent import LocalAlgo, NonPersistentType
from stalwart.cli.arg_types import Float, Int, OneOf, negated, switch, values
from stalwart.config.checks import SEED_MAX
from stalwart.config.training import LRDecayStyle

PRESET_NAMES = ("tiny", "small", "gpt2-124m", "llama-tiny", "llama-150m", "llama-1b")
_PRESET = "(default: the preset's)"


def group(p: argparse.ArgumentParser, table: str, title: str) -> Any:
    """An argument group whose flags ``--print-config`` writes under ``[table]``."""
    g = p.add_argument_group(title)
    g.toml_table = table  # type: ignore[attr-defined]
    return g


def interval(g: Any, flag: str, what: str, zero: str = "off") -> None:
    """An every-N-iterations flag, 0 by default; its help says what 0 means (``zero``)."""
    text = f"{what} every N iterations (default: 0 = {zero})"
    g.add_argument(flag, type=int, default=0, help=text)


FAST_PATH_DEFAULT = "(default: on with --compile and full-iteration graphs, else off)"


def fast_path(g: Any, flag: str, text: str) -> None:
    """A ``--x/--no-x`` switch that compiled full-iteration graphs turn on unless it is given
    (`stalwart.config.fast_path`): unset is None."""
    g.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{text} {FAST_PATH_DEFAULT}",
    )


def model_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "model", "model")
    values(
        g,
        ("--preset", OneOf(PRESET_NAMES, "NAME"), "tiny", "model size preset"),
        ("--num-layers", int, None, f"transformer layers {_PRESET}"),
        ("--hidden-size", int, None, f"model width {_PRESET}"),
        ("--num-attention-heads", int, None, f"attention heads {_PRESET}"),
        ("--seq-length", int, None, f"tokens per sample {_PRESET}"),
        ("--ffn-hidden-size", int, None, "MLP width (default: the preset's, else 4 x hidden)"),
        ("--vocab-size", int, None, f"vocabulary size {_PRESET}"),
        (
            "--hidden-dropout",
            float,
            None,
            "dropout everywhere: embeddings, attention, residuals (default: 0.0)",
        ),
        (
            "--num-experts",
            Int(1),
            None,
            "MoE experts per layer, >= 1 (default: none, a dense MLP; Megatron's meaning)",
        ),
        ("--moe-router-topk", int, None, "experts per token (default: 2)"),
        ("--moe-aux-loss-coeff", float, None, "load-balancing loss weight (default: 0.01)"),
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        "--moe-capacity-factor",
        dest="moe_capacity_factor",
        type=Float(gt=0),
        help="per-expert capacity; tokens beyond it are dropped (default: 1.25)",
    )
    # The last four are Megatron's flags whose value stalwart's model derives from others:
    # accepted when they agree (``stalwart.config.model.check_megatron_model_flags``).
    values(
        g,
        ("--init-method-std", Float(gt=0), None, "std of the weight init (default: 0.02)"),
        (
            "--max-position-embeddings",
            Int(1),
            None,
            ">= --seq-length; = --seq-length with learned positions",
        ),
        ("--kv-channels", Int(1), None, "= --hidden-size / --num-attention-heads"),
        ("--attention-dropout", float, None, "= --hidden-dropout, the one dropout"),
        (
            "--make-vocab-size-divisible-by",
            Int(1),
            None,
            "--vocab-size must be a multiple: no padding",
        ),
    )


def architecture_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's Llama switches; unset flags keep the preset's value (llama-* presets set them)."""
    g = group(p, "model.architecture", "model: architecture (GPT-2 unless a llama-* preset)")
    values(
        g,
        (
            "--position-embedding-type",
            OneOf(("learned_absolute", "rope"), "KIND"),
            None,
            f"learned absolute positions (GPT-2) or rotary embeddings (Llama) {_PRESET}",
        ),
        ("--rotary-base", int, None, "RoPE base, rope only (default: 10000)"),
        (
            "--rope-scaling-factor",
            Float(gt=0),
            None,
            "Llama 3.x RoPE scaling factor, with --use-rope-scaling (default: 8.0)",
        ),
        (
            "--normalization",
            OneOf(("LayerNorm", "RMSNorm"), "KIND"),
            None,
            f"norm of every layer {_PRESET}",
        ),
        ("--norm-epsilon", Float(gt=0), None, "epsilon of every norm (default: 1e-5)"),
    )
    for flag, text in (
        ("--swiglu", "SwiGLU MLP (3 matrices) instead of GELU"),
        ("--untie-embeddings-and-output-weights", "an output layer of its own, not the embedding"),
        ("--disable-bias-linear", "no biases in attention/MLP linear layers"),
        ("--use-rope-scaling", "Llama 3.x RoPE frequency scaling (rope only)"),
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
    values(
        g,
        (
            "--recompute-granularity",
            OneOf(("full", "selective"), "KIND"),
            None,
            "selective: the attention core; full: whole layers (with --recompute-method and "
            "--recompute-num-layers) (default: off)",
        ),
        (
            "--recompute-method",
            OneOf(("uniform", "block"), "KIND"),
            None,
            "full: uniform groups of --recompute-num-layers, or block: the first ones",
        ),
        (
            "--recompute-num-layers",
            int,
            None,
            "full: layers per group (uniform) or recomputed (block)",
        ),
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
    values(
        g,
        (
            "--data-dtype",
            OneOf(("uint16", "uint32"), "DTYPE"),
            "uint16",
            "dtype of the token ids of a .bin file",
        ),
        ("--valid-fraction", float, 0.02, "held-out share of the data"),
    )
    negated(g, "--no-shuffle", "read samples in order instead of a seeded shuffle")
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
    fast_path(
        g,
        "--bf16-compute-weights",
        "with --bf16: bf16 copies of the Linear weights made once per iteration, not autocast's "
        "per micro-batch; their grads added into the fp32 grads (not with --use-torch-fsdp2)",
    )
    fast_path(
        g,
        "--gradient-accumulation-fusion",
        "with --bf16-compute-weights: the weight-gradient GEMMs and the lookup add into the "
        "fp32 grads (no bf16 grad per micro-batch)",
    )
    switch(
        g,
        "--bf16-residual-connection",
        "with --bf16: the residual stream in bf16, not fp32 (Megatron's default under bf16); "
        "changes the numerics, so never on by default",
    )
    fast_path(
        g,
        "--cross-entropy-loss-fusion",
        "the output layer and the loss as one op whose forward writes the logits' gradient in "
        "place (a Triton kernel on CUDA)",
    )
    values(
        g,
        ("--initial-loss-scale", float, 2.0**16, "fp16 starting scale"),
        ("--min-loss-scale", float, 1.0, "fp16 scale floor"),
        ("--loss-scale-window", int, 1000, "fp16: clean iterations to grow"),
        ("--hysteresis", int, 2, "fp16: overflows before shrinking"),
    )


def training_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "training", "training")
    values(
        g,
        ("--micro-batch-size", int, None, "samples per rank per forward-backward (default: 8)"),
        (
            "--global-batch-size",
            int,
            None,
            "samples per iteration (default: micro batch x data-parallel ranks)",
        ),
    )
    g.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCR", "SAMPLES"),
        help="grow the global batch from START by INCR over SAMPLES samples (default: off)",
    )
    values(
        g,
        # None here, 100 in build_run_config: --train-samples must know whether it was given.
        ("--train-iters", int, None, "iterations to train in total (default: 100)"),
        (
            "--train-samples",
            int,
            None,
            "train this many samples instead; the LR schedule then counts samples",
        ),
        ("--seed", Int(0, SEED_MAX), 1234, "seed of init and data"),
    )
    _precision_flags(g)
    interval(g, "--eval-interval", "evaluate", zero="never")
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
    interval(g, "--manual-gc-interval", "--manual-gc", zero="around eval only")
    negated(g, "--no-manual-gc-eval", "--manual-gc: not around evaluation")


def optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "optimizer", "optimizer and learning-rate schedule (AdamW)")
    values(
        g,
        ("--lr", float, 3e-4, "peak learning rate"),
        ("--min-lr", float, 0.0, "learning rate at the end of decay"),
        ("--weight-decay", float, 0.1, "AdamW weight decay"),
        ("--adam-beta1", float, 0.9, "AdamW beta1"),
        ("--adam-beta2", float, 0.95, "AdamW beta2"),
        ("--adam-eps", float, 1e-8, "AdamW epsilon"),
        ("--clip-grad", float, 1.0, "gradient norm clip (default: 1.0; 0 = off)"),
    )
    fast_path(
        g,
        "--clip-grad-in-optimizer",
        "the --clip-grad factor inside the fused AdamW step, not a pass over the gradients "
        "(the same norm; not with --use-torch-fsdp2)",
    )
    values(
        g,
        ("--lr-decay-style", OneOf(LRDecayStyle, "STYLE"), LRDecayStyle.COSINE, "decay shape"),
        ("--lr-warmup-iters", int, 0, "linear warm-up iterations"),
        ("--lr-decay-iters", int, None, "decay ends here (default: --train-iters)"),
        ("--lr-warmup-samples", int, 0, "warm-up samples (--train-samples)"),
        ("--lr-decay-samples", int, None, "decay ends here, in samples (default: --train-samples)"),
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
    interval(g, "--save-interval", "save")
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
    interval(g, "--non-persistent-save-interval", "also save a non-persistent checkpoint")
    non_persistent_flags(g)


def non_persistent_flags(g: Any) -> None:
    """Megatron's non-persistent checkpoint types (``stalwart.checkpoint.non_persistent``)."""
    values(
        g,
        (
            "--non-persistent-ckpt-type",
            OneOf(NonPersistentType, "TYPE"),
            NonPersistentType.GLOBAL,
            "where they go",
        ),
        (
            "--non-persistent-local-ckpt-algo",
            OneOf(LocalAlgo, "ALGO"),
            None,
            "local: spread the state over the ranks (unset: fully_parallel)",
        ),
        (
            "--replication-jump",
            int,
            None,
            "local: ranks between a shard's copies (default: per node)",
        ),
        ("--replication-factor", int, None, "local: copies of each shard (default: 2)"),
    )
    g.add_argument(
        "--non-persistent-ckpt-dir",
        "--non-persistent-global-ckpt-dir",
        dest="non_persistent_ckpt_dir",
        metavar="DIR",
        help="global: their directory (default: <save>/non_persistent)",
    )
    g.add_argument(
        "--non-persistent-local-ckpt-dir", metavar="DIR", help="local: each node's directory"
    )
    switch(g, "--replication", "local: copy each shard to other nodes")
