"""Megatron-LM flags that stalwart does not implement: each is refused in one line, exit code 2.

A migrating user's script that passes one of these gets ``--X is a Megatron flag stalwart does
not implement (what to do instead)`` instead of argparse's generic "unrecognized arguments" or,
worse, a run that silently differs from the one the script describes. Values that mean "off" in
Megatron are accepted, since they describe what stalwart does anyway (a parallel size of 1,
``--attention-dropout 0``, ``--optimizer adam``). The same refusal applies to ``--config`` keys.

Megatron flags that stalwart implements under its own name are accepted as second spellings of
that flag (``--enable-ft-package`` is ``--enable-ft``); see ``stalwart train --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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

UNSUPPORTED: tuple[Unsupported, ...] = (
    # Model parallelism.
    Unsupported("--tensor-model-parallel-size", f"tensor parallelism; {_DP}", accepted=_ONE),
    Unsupported("--pipeline-model-parallel-size", f"pipeline parallelism; {_DP}", accepted=_ONE),
    Unsupported("--virtual-pipeline-model-parallel-size", f"pipeline parallelism; {_DP}"),
    Unsupported("--num-layers-per-virtual-pipeline-stage", f"pipeline parallelism; {_DP}"),
    Unsupported("--context-parallel-size", f"context parallelism; {_DP}", accepted=_ONE),
    Unsupported("--expert-model-parallel-size", "experts are replicated on every rank", accepted=_ONE),
    Unsupported("--expert-tensor-parallel-size", "experts are replicated on every rank", accepted=_ONE),
    Unsupported("--sequence-parallel", "sequence parallelism needs tensor parallelism", False),
    Unsupported("--use-distributed-optimizer", "shard the optimizer with --use-torch-fsdp2", False),
    Unsupported("--overlap-grad-reduce", "DDP always overlaps the all-reduce with backward", False),
    Unsupported("--overlap-param-gather", "no distributed optimizer: --use-torch-fsdp2", False),
    # Precision and kernels.
    Unsupported("--fp8-format", "FP8 training; use --bf16"),
    Unsupported("--fp8-recipe", "FP8 training; use --bf16"),
    Unsupported("--fp8-param-gather", "FP8 training; use --bf16", False),
    Unsupported("--fp4-format", "FP4 training; use --bf16"),
    Unsupported("--transformer-impl", "Transformer Engine layers; the model is plain PyTorch", accepted=("local",)),
    Unsupported("--attention-backend", "attention is torch's scaled_dot_product_attention"),
    Unsupported("--use-flash-attn", "attention is torch's scaled_dot_product_attention", False),
    Unsupported("--distributed-backend", "the backend follows the device: NCCL, or gloo with --use-cpu"),
    # Data.
    Unsupported("--tokenizer-type", f"no tokenizer; {_TOKENS}"),
    Unsupported("--tokenizer-model", f"no tokenizer; {_TOKENS}"),
    Unsupported("--vocab-file", f"no tokenizer; {_TOKENS}"),
    Unsupported("--merge-file", f"no tokenizer; {_TOKENS}"),
    Unsupported("--split", "one held-out share: --valid-fraction"),
    Unsupported("--mock-data", "without --data-path stalwart trains on its embedded corpus", False),
    Unsupported("--data-cache-path", "datasets are memory-mapped, nothing is cached"),
    # Model.
    Unsupported("--max-position-embeddings", "--seq-length sizes the position table"),
    Unsupported("--attention-dropout", "attention has no dropout (--hidden-dropout is the only one)", accepted=("0", "0.0")),
    Unsupported("--kv-channels", "head size is --hidden-size / --num-attention-heads"),
    Unsupported("--qk-layernorm", "no norm on queries and keys", False),
    Unsupported("--multi-latent-attention", "multi-latent attention", False),
    Unsupported("--mtp-num-layers", "multi-token prediction"),
    Unsupported("--make-vocab-size-divisible-by", "the vocabulary is not padded: --vocab-size"),
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
    Unsupported("--use-persistent-ckpt-worker", "--async-save writes from a worker of its own", False),
    Unsupported("--non-persistent-ckpt-type", "non-persistent checkpoints are local files: --non-persistent-ckpt-dir"),
    Unsupported("--pretrained-checkpoint", "use --load DIR --finetune"),
    # Reliability and observability.
    Unsupported("--exit-signal-handler-for-training", "it exits 0 without saving; use --exit-signal-handler and --exit-on-interrupt", False),
    Unsupported("--straggler-ctrlr-port", "no control port: `touch <run dir>/straggler.toggle` turns --log-straggler on or off at the next log step"),
    Unsupported("--gpu-sniff-test-interval", "no periodic GPU sniff test"),
    Unsupported("--record-memory-history", "use --profile for memory timelines", False),
    Unsupported("--memory-snapshot-path", "use --profile for memory timelines"),
    Unsupported("--inprocess-monitor-process-interval", f"{_INPROCESS} (no monitor process)"),
    Unsupported("--inprocess-progress-watchdog-interval", f"{_INPROCESS} (the monitor thread watches progress)"),
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
    # Per-module CUDA graphs.
    Unsupported("--cuda-graph-modules", _PER_MODULE),
    Unsupported("--cuda-graph-scope", _PER_MODULE),
    Unsupported("--enable-cuda-graph", _PER_MODULE, False),
    Unsupported("--external-cuda-graph", _PER_MODULE, False),
)  # fmt: skip


def refusal_message(flag: str, reason: str) -> str:
    """The one line a refused flag gets (``--X is a Megatron flag stalwart does not implement``)."""
    return f"{flag} is a Megatron flag stalwart does not implement ({reason})"


class MegatronRefusal(argparse.Action):
    """Parses a refused flag (with or without its value) and errors, unless the value is one of
    the accepted ones; stores nothing either way (hidden from ``--help``)."""

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
        if u.takes_value and isinstance(values, str) and values.strip() in u.accepted:
            return  # Megatron's "off": what stalwart does anyway
        parser.error(refusal_message(u.flag, u.reason))


def add_megatron_refusals(parser: argparse.ArgumentParser) -> None:
    """Register every flag of `UNSUPPORTED` on ``parser`` (refused when given)."""
    for unsupported in UNSUPPORTED:
        parser.add_argument(unsupported.flag, action=MegatronRefusal, unsupported=unsupported)
