"""Command-line flags in Megatron spelling, grouped by the component that owns them.

The parser only parses; turning the namespace into typed configs (and validating combinations)
is ``stalwart.config.run.build_run_config``. Parse errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from stalwart.cli.arg_types import Float, Int, register_checked_types
from stalwart.cli.config_file import toml_defaults
from stalwart.config.checks import SEED_MAX

PRESET_NAMES = ("tiny", "small", "gpt2-124m", "llama-tiny", "llama-150m")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (``stalwart train: error: ...``), exit 2.

    Flags must be spelled out (``allow_abbrev=False``, as in Megatron: ``--train-iter`` is not
    ``--train-iters``), and ``type=int`` / ``type=float`` are the checked types of
    ``stalwart.cli.arg_types``. ``raise_errors=True`` raises ``ValueError(message)`` instead of
    exiting (used to parse ``--config`` values key by key).
    """

    def __init__(self, *args: Any, raise_errors: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors
        register_checked_types(self)

    def error(self, message: str) -> NoReturn:
        if self.raise_errors:
            raise ValueError(message)
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model size preset")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--num-experts", type=int, help="MoE experts per layer (0: dense MLP)")
    g.add_argument("--moe-router-topk", type=int)
    g.add_argument("--moe-aux-loss-coeff", type=float)
    g.add_argument(
        "--moe-expert-capacity-factor",
        "--moe-capacity-factor",
        dest="moe_capacity_factor",
        type=Float(gt=0),
        help="per-expert capacity factor (tokens beyond capacity are dropped)",
    )
    g.add_argument("--init-method-std", type=Float(gt=0), help="std of the weight init")


def _architecture_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's Llama switches; unset flags keep the preset's value (llama-* presets set them)."""
    g = p.add_argument_group("model architecture (GPT-2 by default; the llama-* presets set these)")
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        help="learned absolute positions (GPT-2) or rotary embeddings (Llama)",
    )
    g.add_argument("--rotary-base", type=int, help="RoPE base (default 10000; rope only)")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), help="default LayerNorm")
    g.add_argument("--norm-epsilon", type=Float(gt=0), help="epsilon of every norm (default 1e-5)")
    g.add_argument(
        "--swiglu",
        action="store_true",
        default=None,
        help="SwiGLU MLP (3 matrices) instead of GELU",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        default=None,
        help="a separate output layer instead of reusing the word embeddings",
    )
    g.add_argument(
        "--disable-bias-linear",
        action="store_true",
        default=None,
        help="no biases in the attention and MLP linear layers",
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        default=None,
        help="grouped-query attention with --num-query-groups key/value heads",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        help="key/value heads with --group-query-attention (must divide the attention heads; "
        "default 1)",
    )


def _recompute_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recompute")
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        help="selective: recompute the attention core in backward; full: recompute whole layers "
        "(needs --recompute-method and --recompute-num-layers); default off",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        help="full recompute only. uniform: groups of --recompute-num-layers layers each keep "
        "only their input; block: recompute the first --recompute-num-layers layers",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        help="full recompute only: layers per group (uniform; must divide --num-layers) or "
        "layers recomputed (block), 1 to --num-layers",
    )


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        help="file.txt (bytes) or file.bin (token ids); several (equal weights) or "
        "'w1 p1 w2 p2 ...' blend them; default: the embedded corpus",
    )
    g.add_argument(
        "--data-dtype", default="uint16", help="token dtype of a .bin file: uint16|uint32"
    )
    g.add_argument("--valid-fraction", type=float, default=0.02)
    g.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    g.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader worker processes reading micro-batches ahead (0: read in the loop); "
        "they ignore the exit signal so a job-wide SIGTERM still ends in a save",
    )


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCREMENT", "RAMP_SAMPLES"),
        help="grow the global batch from START by INCREMENT over RAMP_SAMPLES samples",
    )
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument(
        "--train-samples",
        type=int,
        help="train until this many samples are consumed (instead of --train-iters); the LR "
        "schedule then counts samples (--lr-warmup-samples, --lr-decay-samples)",
    )
    g.add_argument("--seed", type=Int(0, SEED_MAX), default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--manual-gc",
        action="store_true",
        help="disable Python's automatic GC; collect at the same iterations on every rank",
    )
    g.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="with --manual-gc: collect every N iterations (0: only around evaluation)",
    )
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--use-cpu", action="store_true", help="train on CPU even if CUDA is present")
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--demo", action="store_true", help="defaults for the interactive CPU demo")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int)
    g.add_argument("--lr-decay-style", default="cosine", help="constant|linear|cosine")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--load", help="directory to resume from (default: --save)")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--finetune", action="store_true", help="load weights only, start at iteration 0"
    )
    g.add_argument("--ckpt-keep-last", type=int)
    g.add_argument("--ckpt-fallback", action="store_true")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--non-persistent-save-interval", type=int, default=0)
    g.add_argument("--non-persistent-ckpt-dir")


def _logging_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--metrics-file", help="append one JSON object per logged iteration")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--wandb-mode", choices=("online", "offline", "disabled"))
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0)
    g.add_argument("--timing-log-option", default="minmax")
    g.add_argument("--timing-mode", default="sync", help="sync|events")
    g.add_argument("--log-straggler", action="store_true")
    g.add_argument("--straggler-threshold", type=float, default=1.2)
    g.add_argument("--log-memory-interval", type=int, default=0)
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-energy", action="store_true")
    g.add_argument("--dump-dir", help="directory for activation/dgrad/tokens-per-expert dumps")
    g.add_argument("--save-activations-interval", type=int, default=0)
    g.add_argument("--log-dgrads", action="store_true")
    g.add_argument("--log-tokens-per-expert", action="store_true")
    g.add_argument("--dump-stats-only", action="store_true", help="summary statistics, not tensors")
    g.add_argument("--run-dir", help="where run artefacts (events, memory, report) go")
    g.add_argument(
        "--profile",
        action="store_true",
        help="profile the iterations logged as --profile-step-start + 1 .. --profile-step-end",
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="torch.profiler Chrome traces (else a cudaProfilerStart/Stop range for nsys)",
    )
    g.add_argument("--profile-dir", help="where traces go (default: <run dir>/profile)")
    g.add_argument("--no-progress-bar", dest="progress_bar", action="store_false")


def _rerun_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rerun state machine")
    g.add_argument("--rerun-mode", default="validate_results")
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
    )
    g.add_argument("--check-for-spiky-loss", action="store_true")
    g.add_argument("--check-for-large-grads", action="store_true")
    g.add_argument("--error-injection-rate", type=int, default=0)
    g.add_argument("--error-injection-type", default="transient_error")
    g.add_argument(
        "--error-injection-iterations",
        type=int,
        nargs="+",
        help="iterations (numbered from 1, as logged) eligible for injection "
        "(with --error-injection-rate 1: exactly)",
    )
    g.add_argument("--error-injection-ranks", type=int, nargs="+", help="ranks that inject")
    g.add_argument("--result-rejected-tracker-filename")
    g.add_argument(
        "--check-weight-hash-across-dp-replicas-interval",
        type=int,
        default=0,
        help="every N iterations, compare fingerprints across data-parallel replicas (silent "
        "data corruption): the all-reduced gradients and weights inside the step (a mismatch "
        "is rerun and attributed), and the weights after it and before every save (a mismatch "
        "exits 17 without saving)",
    )
    g.add_argument(
        "--check-weight-hash-sample-fraction",
        type=Float(ge=0.0, le=1.0),
        default=0.0,
        help="every iteration, fingerprint this fraction of the parameters (weights and "
        "all-reduced gradients, each parameter every ceil(1/fraction) iterations) inside the "
        "step, as the interval check does (0: off)",
    )
    g.add_argument(
        "--rerun-peer-replay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attribute a rejection the in-place rerun reproduces by replaying it on a peer "
        "data-parallel replica in the same launch (default with more than one rank); "
        "--no-rerun-peer-replay: exit 16 and rerun after a relaunch (Megatron)",
    )
    g.add_argument(
        "--iterations-to-skip",
        type=int,
        nargs="*",
        default=[],
        help="iterations (numbered from 1, as logged) to skip without training",
    )


def _fault_tolerance_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance and exit")
    g.add_argument("--enable-ft", action="store_true", help="hang detection by timed sections")
    g.add_argument("--ft-timeouts", help="setup=600,step=180,checkpointing=420,out_of_section=600")
    g.add_argument("--calc-ft-timeouts", action="store_true")
    g.add_argument("--ft-num-warmup-iters", type=int, default=5)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--exit-signal", default="SIGTERM")
    g.add_argument("--exit-duration-in-mins", type=float)
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--phase-transition-iterations", type=int, nargs="*", default=[])
    g.add_argument(
        "--inject-fault",
        choices=("hang", "exception", "sigkill", "sigterm", "bitflip", "grad_corruption"),
        help="grad_corruption: one bit of one all-reduced gradient element on one rank, after "
        "the backward (finite; the replica fingerprints of the step must catch it)",
    )
    g.add_argument("--inject-fault-iteration", type=int)
    g.add_argument("--inject-fault-hang-seconds", type=float)
    g.add_argument("--inject-fault-rank", type=int, default=0)
    g.add_argument("--inject-fault-phase", default="step")
    g.add_argument(
        "--inject-fault-repeat", action="store_true", help="fire at every attempt (repeatable)"
    )


def _inprocess_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("in-process restart")
    g.add_argument("--inprocess-restart", action="store_true")
    g.add_argument("--inprocess-max-iterations", type=int, default=3)
    g.add_argument("--inprocess-soft-timeout", type=float, default=60.0)
    g.add_argument("--inprocess-hard-timeout", type=float, default=90.0)
    g.add_argument("--inprocess-heartbeat-interval", type=float, default=1.0)
    g.add_argument("--inprocess-granularity", default="rank", help="rank|node")


def _graph_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CUDA graphs")
    g.add_argument("--cuda-graph-impl", default="none", help="none|full_iteration")
    g.add_argument("--optimizer-cuda-graph", action="store_true")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3)
    g.add_argument(
        "--cuda-graph-speculative-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch the next iteration's graph before this one's validation read (default on)",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _megatron_parity_flags(p: argparse.ArgumentParser) -> None:
    """Megatron flags a migrating user meets (dumps, allocator cache, Ctrl-C)."""
    g = p.add_argument_group("Megatron parity")
    g.add_argument(
        "--save-wgrads-interval",
        type=_non_negative_int,
        default=0,
        help="every N iterations save each parameter's gradient (before clipping) to "
        "<dump dir>/wgrads/iter_N/rank<R>.pt (default 0: off)",
    )
    g.add_argument(
        "--save-params-interval",
        type=_non_negative_int,
        default=0,
        help="every N iterations save the parameters after the optimizer step to "
        "<dump dir>/params/iter_N/rank<R>.pt (default 0: off)",
    )
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="empty the CUDA allocator cache: 1 after forward-backward and each eval step, "
        "2 also after the optimizer step (default 0: never)",
    )
    g.add_argument(
        "--exit-on-interrupt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Ctrl-C (SIGINT) saves (with --save), prints one line and exits 130 (default: on "
        "when a single-process run is attached to a terminal)",
    )


def build_train_parser(
    prog: str = "stalwart train", *, raise_errors: bool = False
) -> argparse.ArgumentParser:
    """The ``stalwart train`` parser (flags only; defaults that depend on the preset are None)."""
    p = OneLineErrorParser(
        prog=prog, description="Train the reference GPT with stalwart.", raise_errors=raise_errors
    )
    p.add_argument("--config", help="TOML file of flag values (flag names, - or _); CLI wins")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    for add in (
        _model_flags,
        _architecture_flags,
        _recompute_flags,
        _data_flags,
        _training_flags,
        _optimizer_flags,
        _checkpoint_flags,
        _logging_flags,
        _rerun_flags,
        _fault_tolerance_flags,
        _inprocess_flags,
        _graph_flags,
        _megatron_parity_flags,
    ):
        add(p)
    return p


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``stalwart train`` flags, applying ``--config run.toml`` values as defaults.

    The namespace's ``config_file_keys`` holds the destinations the file set (they count as
    given explicitly, e.g. ``--demo`` does not override them).
    """
    parser = build_train_parser()
    pre, _ = parser.parse_known_args(argv)
    defaults: dict[str, Any] = {}
    if pre.config:
        try:
            defaults = toml_defaults(pre.config, lambda: build_train_parser(raise_errors=True))
        except ValueError as exc:
            parser.error(str(exc))
        parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    ns.config_file_keys = frozenset(defaults)
    return ns
