"""Megatron-LM flags that stalwart does not implement: each is refused in one line, exit code 2.

A migrating user's script that passes one of these gets ``--X is a Megatron flag stalwart does
not implement (what to do instead)`` instead of argparse's generic "unrecognized arguments" or,
worse, a run that silently differs from the one the script describes. Values that mean "off" in
Megatron are accepted, since they describe what stalwart does anyway (a parallel size of 1,
``--optimizer adam``). The same refusal applies to ``--config`` keys.

`ALWAYS` lists Megatron switches whose effect always holds in stalwart (``--use-flash-attn``,
``--overlap-grad-reduce``): accepted, listed in ``--help`` with the fact that makes them hold.
Megatron flags that stalwart implements under its own name are accepted as second spellings of
that flag (``--enable-ft-package`` is ``--enable-ft``); value flags that must agree with the model
(``--max-position-embeddings``, ``--kv-channels``, ``--attention-dropout``,
``--make-vocab-size-divisible-by``) are checked by ``stalwart.config.model``. `LONG_TAIL`
refuses the rest of Megatron's flags (MLA, Retro, inference, hybrid Mamba, vision, RL, ...) by
group, from the data in ``megatron_flags_tail``. Any other unknown flag gets "did you mean"
from the flags of `stalwart train` (`unknown_flag_message`). docs/migration-megatron.md is the
table for users.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from stalwart.cli.megatron_flags_tail import TAIL, TAIL_ACCEPTED


@dataclass(frozen=True)
class Unsupported:
    """One refused flag: why (and what to use instead), whether it takes a value, which values
    are accepted because they mean what stalwart does."""

    flag: str
    reason: str
    takes_value: bool = True
    accepted: tuple[str, ...] = ()


_DP = "stalwart trains data-parallel: DDP, or --use-torch-fsdp2"
_ONE = ("1",)
_TOKENS = "--data-path takes token ids (.bin) or raw bytes (.txt)"
_WD = "weight decay is constant: --weight-decay"
_CKPT = "checkpoints are torch.distributed.checkpoint directories of their own layout"
_PER_MODULE = "stalwart graphs the whole iteration: --cuda-graph-impl full_iteration"
_FAULTS = "use --inject-fault KIND --inject-fault-iteration N"
_INPROCESS = "stalwart's in-process restart has no such knob"
_TP = f"tensor parallelism; {_DP}"
_PP = f"pipeline parallelism; {_DP}"
_FUSION = "a fused kernel of Transformer Engine / Apex; the model is plain PyTorch"
_MOE = "experts are replicated dense MLPs with one top-k softmax router"
_OPTIM = "the optimizer is AdamW with fp32 states: --adam-beta1/--adam-beta2/--adam-eps"

UNSUPPORTED: tuple[Unsupported, ...] = (
    # Model parallelism.
    Unsupported("--tensor-model-parallel-size", _TP, accepted=_ONE),
    Unsupported("--pipeline-model-parallel-size", _PP, accepted=_ONE),
    Unsupported("--virtual-pipeline-model-parallel-size", _PP),
    Unsupported("--num-layers-per-virtual-pipeline-stage", _PP),
    Unsupported("--context-parallel-size", f"context parallelism; {_DP}", accepted=_ONE),
    Unsupported(
        "--expert-model-parallel-size", "experts are replicated on every rank", accepted=_ONE
    ),
    Unsupported(
        "--expert-tensor-parallel-size", "experts are replicated on every rank", accepted=_ONE
    ),
    Unsupported("--sequence-parallel", "sequence parallelism needs tensor parallelism", False),
    Unsupported("--use-distributed-optimizer", "shard the optimizer with --use-torch-fsdp2", False),
    Unsupported("--overlap-param-gather", "no distributed optimizer: --use-torch-fsdp2", False),
    # Precision and kernels.
    Unsupported("--fp8-format", "FP8 training; use --bf16"),
    Unsupported("--fp8-recipe", "FP8 training; use --bf16"),
    Unsupported("--fp8-param-gather", "FP8 training; use --bf16", False),
    Unsupported("--fp4-format", "FP4 training; use --bf16"),
    Unsupported(
        "--transformer-impl",
        "Transformer Engine layers; the model is plain PyTorch",
        accepted=("local",),
    ),
    Unsupported(
        "--attention-backend",
        "attention is torch's scaled_dot_product_attention, which picks its kernel itself (auto)",
        accepted=("auto",),
    ),
    Unsupported(
        "--distributed-backend",
        "the backend follows the device: NCCL, or gloo with --use-cpu",
        accepted=("nccl",),
    ),
    # Data.
    Unsupported("--tokenizer-type", f"no tokenizer; {_TOKENS}", accepted=("NullTokenizer",)),
    Unsupported("--tokenizer-model", f"no tokenizer; {_TOKENS}"),
    Unsupported("--vocab-file", f"no tokenizer; {_TOKENS}"),
    Unsupported("--merge-file", f"no tokenizer; {_TOKENS}"),
    Unsupported("--split", "one held-out share: --valid-fraction"),
    Unsupported("--mock-data", "without --data-path stalwart trains on its embedded corpus", False),
    Unsupported("--data-cache-path", "datasets are memory-mapped, nothing is cached"),
    # Model.
    Unsupported("--qk-layernorm", "no norm on queries and keys", False),
    Unsupported("--multi-latent-attention", "multi-latent attention", False),
    Unsupported("--mtp-num-layers", "multi-token prediction"),
    Unsupported("--moe-grouped-gemm", "experts run as separate MLPs", False),
    Unsupported("--moe-token-dispatcher-type", "experts are replicated: no token dispatch"),
    Unsupported("--moe-router-load-balancing-type", "one auxiliary loss: --moe-aux-loss-coeff"),
    # Optimizer and schedule.
    Unsupported("--optimizer", "the optimizer is AdamW", accepted=("adam",)),
    Unsupported("--lr-warmup-fraction", "use --lr-warmup-iters"),
    Unsupported("--lr-warmup-init", "warm-up starts at --lr / --lr-warmup-iters"),
    Unsupported("--lr-wsd-decay-style", "no WSD schedule: --lr-decay-style"),
    Unsupported("--lr-wsd-decay-iters", "no WSD schedule: --lr-decay-style"),
    Unsupported("--start-weight-decay", _WD),
    Unsupported("--end-weight-decay", _WD),
    Unsupported("--weight-decay-incr-style", _WD),
    # Checkpoints.
    Unsupported("--ckpt-format", _CKPT),
    Unsupported("--use-dist-ckpt", _CKPT, False),
    Unsupported("--auto-detect-ckpt-format", _CKPT, False),
    Unsupported("--dist-ckpt-strictness", _CKPT),
    Unsupported("--ckpt-assume-constant-structure", _CKPT, False),
    Unsupported(
        "--use-persistent-ckpt-worker", "--async-save writes from a worker of its own", False
    ),
    Unsupported("--pretrained-checkpoint", "use --load DIR --finetune"),
    # Reliability and observability.
    Unsupported(
        "--exit-signal-handler-for-training",
        "it exits 0 without saving; use --exit-signal-handler and --exit-on-interrupt",
        False,
    ),
    Unsupported(
        "--straggler-ctrlr-port",
        "no control port: `touch <run dir>/straggler.toggle` turns --log-straggler on or off at "
        "the next log step",
    ),
    Unsupported("--gpu-sniff-test-interval", "no periodic GPU sniff test"),
    Unsupported("--record-memory-history", "use --profile for memory timelines", False),
    Unsupported("--memory-snapshot-path", "use --profile for memory timelines"),
    Unsupported("--inprocess-monitor-process-interval", f"{_INPROCESS} (no monitor process)"),
    Unsupported(
        "--inprocess-progress-watchdog-interval",
        f"{_INPROCESS} (the monitor thread watches progress)",
    ),
    Unsupported("--inprocess-completion-timeout", _INPROCESS),
    Unsupported("--inprocess-last-call-wait", _INPROCESS),
    Unsupported("--inprocess-termination-grace-time", f"{_INPROCESS} (a hard timeout is SIGKILL)"),
    Unsupported("--inprocess-active-world-size", f"{_INPROCESS} (no spare ranks)"),
    Unsupported("--fault-injector-ranks", _FAULTS),
    Unsupported("--fault-injector-num-ranks", _FAULTS),
    Unsupported("--fault-injector-fault-types", _FAULTS),
    Unsupported("--fault-injector-fault-probabilities", _FAULTS),
    Unsupported("--fault-injector-fault-delay", _FAULTS),
    Unsupported("--fault-injector-delay-start-iteration", _FAULTS),
    Unsupported("--fault-injector-mtti-seconds", _FAULTS),
    Unsupported("--fault-injector-offset-seconds", _FAULTS),
    Unsupported("--fault-injector-seed", _FAULTS),
    # Parallelism and communication.
    Unsupported("--decoder-first-pipeline-num-layers", _PP),
    Unsupported("--decoder-last-pipeline-num-layers", _PP),
    Unsupported("--account-for-embedding-in-pipeline-split", _PP, False),
    Unsupported("--account-for-loss-in-pipeline-split", _PP, False),
    Unsupported("--tp-comm-overlap", _TP, False),
    Unsupported("--no-async-tensor-model-parallel-allreduce", _TP, False),
    Unsupported(
        "--use-mcore-models",
        "stalwart's GPT is its own (stalwart.models.GPT): drop the flag",
        False,
    ),
    Unsupported(
        "--use-legacy-models",
        "stalwart's GPT is its own (stalwart.models.GPT): drop the flag",
        False,
    ),
    Unsupported("--spec", "stalwart's GPT is its own (stalwart.models.GPT): no layer specs"),
    Unsupported("--ddp-bucket-size", "DDP uses torch's bucket size"),
    Unsupported("--ddp-average-in-collective", "DDP averages after its all-reduce", False),
    Unsupported("--grad-reduce-in-bf16", "gradients are reduced in fp32", False),
    Unsupported("--nccl-communicator-config-path", "process groups use NCCL's defaults"),
    # Model.
    Unsupported(
        "--apply-query-key-layer-scaling",
        "attention scales scores by 1/sqrt(head size) only",
        False,
    ),
    Unsupported(
        "--attention-softmax-in-fp32",
        "attention is torch's scaled_dot_product_attention; its kernel picks the softmax precision",
        False,
    ),
    Unsupported("--apply-residual-connection-post-layernorm", "layers are pre-norm", False),
    Unsupported("--apply-layernorm-1p", "norms scale by their weight, not 1 + weight", False),
    Unsupported("--openai-gelu", "the MLP is GELU, or SwiGLU with --swiglu", False),
    Unsupported("--squared-relu", "the MLP is GELU, or SwiGLU with --swiglu", False),
    Unsupported("--init-method-xavier-uniform", "weights are normal with --init-method-std", False),
    Unsupported("--use-rotary-position-embeddings", "use --position-embedding-type rope", False),
    Unsupported("--recompute-activations", "use --recompute-granularity selective", False),
    Unsupported("--rotary-percent", "RoPE rotates the whole head", accepted=("1", "1.0")),
    Unsupported("--rotary-seq-len-interpolation-factor", "no RoPE interpolation"),
    Unsupported(
        "--no-position-embedding",
        "learned positions are --position-embedding-type learned_absolute; RoPE models have no "
        "position table already",
        False,
    ),
    Unsupported("--moe-ffn-hidden-size", f"{_MOE} of --ffn-hidden-size"),
    Unsupported("--moe-layer-freq", "with --num-experts every layer's MLP is MoE", accepted=("1",)),
    Unsupported("--moe-router-dtype", _MOE),
    Unsupported("--moe-router-score-function", _MOE, accepted=("softmax",)),
    Unsupported("--moe-router-pre-softmax", _MOE, False),
    Unsupported("--moe-z-loss-coeff", f"{_MOE}; one auxiliary loss: --moe-aux-loss-coeff"),
    Unsupported("--moe-shared-expert-intermediate-size", f"{_MOE}; no shared experts"),
    Unsupported("--moe-permute-fusion", _FUSION, False),
    Unsupported("--moe-input-jitter-eps", f"{_MOE}; no input jitter"),
    # Precision and fusions.
    Unsupported(
        "--loss-scale",
        "--fp16 scales dynamically: --initial-loss-scale, --min-loss-scale, --loss-scale-window, "
        "--hysteresis",
    ),
    Unsupported("--use-precision-aware-optimizer", _OPTIM, False),
    Unsupported("--main-grads-dtype", _OPTIM, accepted=("fp32",)),
    Unsupported("--main-params-dtype", _OPTIM, accepted=("fp32",)),
    Unsupported("--exp-avg-dtype", _OPTIM, accepted=("fp32",)),
    Unsupported("--exp-avg-sq-dtype", _OPTIM, accepted=("fp32",)),
    Unsupported("--decoupled-lr", "one learning rate for every parameter: --lr"),
    Unsupported("--decoupled-min-lr", "one learning rate for every parameter: --min-lr"),
    Unsupported("--sgd-momentum", _OPTIM),
    Unsupported("--deterministic-mode", "no deterministic-kernel mode", False),
    Unsupported(
        "--calculate-per-token-loss", "no per-token loss normalisation across micro-batches", False
    ),
    # Data.
    Unsupported(
        "--dataloader-type", "stalwart's sampler is its own: a seeded shuffle, or --no-shuffle"
    ),
    Unsupported("--train-data-path", "one --data-path blend, split by --valid-fraction"),
    Unsupported("--valid-data-path", "one --data-path blend, split by --valid-fraction"),
    Unsupported(
        "--test-data-path", "no test split: one --data-path blend, split by --valid-fraction"
    ),
    Unsupported("--data-args-path", "give the files to --data-path"),
    Unsupported("--per-split-data-args-path", "give the files to --data-path"),
    Unsupported("--num-dataset-builder-threads", "datasets are memory-mapped, nothing is built"),
    Unsupported("--no-mmap-bin-files", "datasets are always memory-mapped", False),
    Unsupported("--reset-position-ids", "positions restart only at a sample's start", False),
    Unsupported("--reset-attention-mask", "attention is causal over the whole sample", False),
    Unsupported("--eod-mask-loss", "every token's loss counts", False),
    # Checkpoints.
    Unsupported(
        "--no-save-optim",
        "checkpoints always hold the optimizer state; load without it: --no-load-optim",
        False,
    ),
    Unsupported(
        "--no-save-rng",
        "checkpoints always hold the RNG states; load without them: --no-load-rng",
        False,
    ),
    Unsupported(
        "--use-checkpoint-args",
        "a checkpoint does not set the model flags; the run's own flags must match it (checked at "
        "load)",
        False,
    ),
    Unsupported("--ckpt-fully-parallel-save", _CKPT, False),
    Unsupported("--no-ckpt-fully-parallel-save", _CKPT, False),
    Unsupported("--ckpt-fully-parallel-load", _CKPT, False),
    Unsupported("--save-retain-interval", "retention keeps the last N: --ckpt-keep-last"),
    Unsupported(
        "--exit-on-missing-checkpoint", "a --load without a checkpoint starts at iteration 0", False
    ),
    Unsupported(
        "--no-initialization", "the model is always initialised (--init-method-std)", False
    ),
    Unsupported("--data-impl", "datasets are memory-mapped", accepted=("mmap",)),
    Unsupported(
        "--adlr-autoresume", "no ADLR autoresume: --exit-signal-handler saves on SIGTERM", False
    ),
    Unsupported(
        "--adlr-autoresume-interval", "no ADLR autoresume: --exit-signal-handler saves on SIGTERM"
    ),
    Unsupported("--fp16-lm-cross-entropy", "the cross entropy is computed in fp32", False),
    Unsupported(
        "--num-distributed-optimizer-instances",
        "no distributed optimizer: --use-torch-fsdp2",
        accepted=("1",),
    ),
    Unsupported("--use-custom-fsdp", "use --use-torch-fsdp2", False),
    Unsupported("--use-megatron-fsdp", "use --use-torch-fsdp2", False),
    Unsupported(
        "--data-parallel-sharding-strategy",
        "--use-torch-fsdp2 shards parameters, gradients and optimizer states",
    ),
    Unsupported("--optimizer-cpu-offload", "the optimizer states stay on the device", False),
    Unsupported(
        "--overlap-param-gather-with-optimizer-step",
        "no distributed optimizer: --use-torch-fsdp2",
        False,
    ),
    Unsupported(
        "--cpu-offloading", "no activation offloading: --recompute-granularity saves memory", False
    ),
    Unsupported(
        "--fine-grained-activation-offloading",
        "no activation offloading: --recompute-granularity saves memory",
        False,
    ),
    Unsupported("--moe-router-enable-expert-bias", _MOE, False),
    Unsupported("--moe-router-bias-update-rate", _MOE),
    Unsupported("--te-rng-tracker", "Transformer Engine layers; the model is plain PyTorch", False),
    # Logging.
    Unsupported("--log-memory-interval-to-tensorboard", "use --log-memory-to-tensorboard", False),
    Unsupported(
        "--no-log-learning-rate-to-tensorboard", "the learning rate is always written", False
    ),
    Unsupported("--enable-one-logger", "no OneLogger: --tensorboard-dir, --wandb-project", False),
    Unsupported("--wandb-entity", "W&B reads the entity from WANDB_ENTITY"),
    # Per-module CUDA graphs.
    Unsupported("--cuda-graph-modules", _PER_MODULE),
    Unsupported("--cuda-graph-scope", _PER_MODULE),
    Unsupported("--enable-cuda-graph", _PER_MODULE, False),
    Unsupported("--external-cuda-graph", _PER_MODULE, False),
)


LONG_TAIL: tuple[Unsupported, ...] = tuple(
    Unsupported(flag, reason, takes_value, TAIL_ACCEPTED.get(flag, ()))
    for reason, values, switches in TAIL
    for takes_value, names in ((True, values), (False, switches))
    for flag in names.split()
)
"""Every other flag of Megatron-LM's arguments.py that stalwart lacks, refused like
`UNSUPPORTED`."""


@dataclass(frozen=True)
class Always:
    """A Megatron switch whose effect always holds in stalwart: accepted, with the fact why."""

    flag: str
    fact: str


ALWAYS: tuple[Always, ...] = (
    Always(
        "--use-flash-attn",
        "attention is torch's scaled_dot_product_attention, which runs its flash kernel where the "
        "device and dtype allow",
    ),
    Always(
        "--overlap-grad-reduce",
        "DDP overlaps the gradient all-reduce with backward, FSDP2 its reduce-scatter",
    ),
    Always(
        "--accumulate-allreduce-grads-in-fp32",
        "gradients are accumulated and reduced in fp32 (the parameters' dtype)",
    ),
    Always(
        "--no-masked-softmax-fusion",
        "attention is torch's scaled_dot_product_attention, no Megatron softmax kernel",
    ),
    Always(
        "--no-bias-dropout-fusion", "bias, dropout and the residual add are separate PyTorch ops"
    ),
    Always("--no-bias-gelu-fusion", "bias and GELU are separate PyTorch ops"),
    Always("--no-bias-swiglu-fusion", "SwiGLU is separate PyTorch ops"),
    Always("--no-rope-fusion", "RoPE is PyTorch ops"),
    Always("--no-persist-layer-norm", "norms are torch.nn.functional ops"),
    Always(
        "--use-cpu-initialization", "the model is initialised on the CPU, then moved to the device"
    ),
    Always(
        "--no-create-attention-mask-in-dataloader",
        "attention is causal in the kernel; no mask is built",
    ),
)


def refusal_message(flag: str, reason: str) -> str:
    """The one line a refused flag gets (``--X is a Megatron flag stalwart does not implement``)."""
    return f"{flag} is a Megatron flag stalwart does not implement ({reason})"


class MegatronRefusal(argparse.Action):
    """Parses a refused flag (with or without its value) and errors, unless the value is one of
    the accepted ones; stores nothing either way (hidden from ``--help``)."""

    holds = False  # MegatronAlways: the switch's effect holds, so it is accepted

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.unsupported: Unsupported = kwargs.pop("unsupported")
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            nargs="?" if self.unsupported.takes_value else 0,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        u = self.unsupported
        if self.holds:
            return  # an `ALWAYS` switch: its effect holds anyway
        if u.takes_value and isinstance(values, str) and values.strip() in u.accepted:
            return  # Megatron's "off": what stalwart does anyway
        parser.error(refusal_message(u.flag, u.reason))


class MegatronAlways(MegatronRefusal):
    """A switch of `ALWAYS`: parsed and accepted, stores nothing (its effect holds anyway)."""

    holds = True

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        always: Always = kwargs.pop("always")
        super().__init__(
            option_strings, dest, unsupported=Unsupported(always.flag, always.fact, False)
        )
        # Hidden, like a refusal: the group's description lists them all in one paragraph.


def add_megatron_refusals(parser: argparse.ArgumentParser) -> None:
    """Register every flag of `UNSUPPORTED` and `LONG_TAIL` on ``parser`` (refused when given)
    and every switch of `ALWAYS` (accepted; ``--help`` lists them in one group description)."""
    for unsupported in (*UNSUPPORTED, *LONG_TAIL):
        parser.add_argument(unsupported.flag, action=MegatronRefusal, unsupported=unsupported)
    parser.add_argument_group(
        "Megatron switches whose effect always holds (accepted, change nothing)",
        ", ".join(a.flag for a in ALWAYS) + " (each one's reason: docs/migration-megatron.md)",
    )
    for always in ALWAYS:
        parser.add_argument(always.flag, action=MegatronAlways, always=always)


def unknown_flag_message(tokens: Iterable[str], known: Iterable[str]) -> str:
    """argparse's "unrecognized arguments" as one line naming each unknown flag, with "did you
    mean" for a close spelling of a flag in ``known`` (a typo), else saying it is not a flag of
    stalwart or of the Megatron flags it knows."""
    known = sorted(set(known))
    parts: list[str] = []
    after_flag = False
    for token in tokens:
        if not token.startswith("-"):
            if not after_flag:  # an unknown flag's own value is not named again
                parts.append(repr(token))
            continue
        after_flag = "=" not in token
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            parts.append(f"{name} (did you mean {close[0]}?)")
        else:
            parts.append(
                f"{name} (neither a stalwart flag nor a Megatron flag stalwart knows; "
                "docs/migration-megatron.md lists them)"
            )
    return "unrecognized arguments: " + ", ".join(parts)
