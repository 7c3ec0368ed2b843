"""Configuration checks for CUDA graphs x recompute x host-syncing checks x compile.

``graph_config_problems`` is a pure decision function returning every violated rule as a
one-line reason naming the offending flag (Megatron spelling); ``check_graph_config`` raises one
``ValueError`` listing them. Only settings a path can set are checked: Megatron's per-module
graphs (``--cuda-graph-modules``, ``--cuda-graph-scope``, ``--enable-cuda-graph``,
``--cuda-graph-impl local|transformer_engine``), activation offloading,
``--moe-input-jitter-eps``, ``--loss-scale`` and other optimizers are refused in one line where
they are given (``stalwart.cli.megatron_flags``, ``GraphConfig``), so no graph rule meets them.
Rules follow Megatron's ``TransformerConfig``/``arguments.py`` checks,
with one deliberate difference: the NaN/Inf, spiky-loss and large-gradient checks stay on under
``full_iteration`` (Megatron turns the NaN check off and forgets the others, which sync inside
the captured region). Here they are device work writing the rerun machine's buffer
(``stalwart.reliability.rerun.ValidationBuffer``), verdicts included.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

import torch


class CudaGraphImpl(enum.Enum):
    """``--cuda-graph-impl``: stalwart implements ``none`` and ``full_iteration``; Megatron's
    per-layer ``local`` and ``transformer_engine`` are its names, refused where a run is
    configured (``stalwart.config.run.GraphConfig``: one line saying why)."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


class RecomputeChoice(Protocol):
    """``--recompute-granularity`` as the model's config holds it (``stalwart.models.
    RecomputeGranularity``): the checks read its value, ``"none"``, ``"selective"`` or ``"full"``.
    Any model's enum of those values works; graphs does not import the reference model."""

    @property
    def value(self) -> str: ...


GRAPHABLE_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
_GRAPHED_COMPILE_MODES = ("reduce-overhead", "max-autotune")
# recompute module -> the dropout setting whose randomness it would replay inside the graph.
# ``stalwart.models`` recomputes 'core_attn' (selective) or whole layers (full: the attention
# core and the layer's MLP, which is 'moe' in a MoE model and 'mlp' otherwise).
_RANDOM_RECOMPUTE = {
    "core_attn": "attention_dropout",
    "mlp": "hidden_dropout",
    "moe": "hidden_dropout",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphSettings:
    """The flags that interact with CUDA graphs (Megatron names, underscores for dashes)."""

    device: torch.device
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.NONE
    cuda_graph_warmup_steps: int = 3
    optimizer_cuda_graph: bool = False
    recompute_granularity: RecomputeChoice | None = None  # None: no recompute
    recompute_modules: tuple[str, ...] = ()
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # The flags that set the two dropouts, as messages name them: a caller with one dropout
    # for both (stalwart's trainer: --hidden-dropout) passes its flag for both.
    attention_dropout_flag: str = "--attention-dropout"
    hidden_dropout_flag: str = "--hidden-dropout"
    has_moe: bool = False  # the layers' MLP is a mixture of experts ('moe', else 'mlp')
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    log_num_zeros_in_grad: bool = False
    fp16: bool = False  # stalwart's --fp16 scales the loss dynamically (Megatron's default)
    compile: bool = False
    compile_mode: str = "default"


def _impl_problems(s: GraphSettings) -> list[str]:
    problems: list[str] = []
    full = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION
    if (full or s.optimizer_cuda_graph) and s.device.type != "cuda":
        flag = "--cuda-graph-impl full_iteration" if full else "--optimizer-cuda-graph"
        problems.append(f"{flag} requires a CUDA device (got device '{s.device}')")
    if full and (
        isinstance(s.cuda_graph_warmup_steps, bool)
        or not isinstance(s.cuda_graph_warmup_steps, int)
        or s.cuda_graph_warmup_steps < 1
    ):
        problems.append(
            f"--cuda-graph-warmup-steps must be an integer >= 1 with full_iteration, got "
            f"{s.cuda_graph_warmup_steps!r}"
        )
    return problems


def _recompute_problems(s: GraphSettings) -> list[str]:
    full = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION
    granularity = "none" if s.recompute_granularity is None else s.recompute_granularity.value
    if not full or granularity == "none":
        return []
    modules = (
        ("core_attn", "moe" if s.has_moe else "mlp")
        if granularity == "full"
        else s.recompute_modules
    )
    return _random_recompute_problems(s, modules)


def _random_recompute_problems(s: GraphSettings, modules: tuple[str, ...]) -> list[str]:
    """One reason per dropout flag that is non-zero, naming the recomputed modules it reaches."""
    by_flag: dict[tuple[str, float], list[str]] = {}
    for module in modules:
        field = _RANDOM_RECOMPUTE.get(module)
        if field is None or getattr(s, field) == 0.0:
            continue
        flag = s.attention_dropout_flag if field == "attention_dropout" else s.hidden_dropout_flag
        by_flag.setdefault((flag, getattr(s, field)), []).append(f"'{module}'")
    return [
        f"{flag}={value} is not allowed with recomputed {', '.join(names)} inside a "
        "full_iteration CUDA graph: recompute's RNG save/restore cannot be captured (set it "
        "to 0, or recompute nothing)"
        for (flag, value), names in by_flag.items()
    ]


def _host_sync_problems(s: GraphSettings) -> list[str]:
    problems: list[str] = []
    if s.optimizer_cuda_graph and s.log_num_zeros_in_grad:
        problems.append(
            "--log-num-zeros-in-grad syncs with the host inside the optimizer step; it cannot "
            "be used with --optimizer-cuda-graph"
        )
    graphs = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION or s.optimizer_cuda_graph
    if graphs and s.fp16:
        problems.append(
            "--fp16 with dynamic loss scaling is not supported with CUDA graphs (the found-inf "
            "skip decision syncs with the host); use --bf16"
        )
    return problems


def _compile_problems(s: GraphSettings) -> list[str]:
    if not s.compile or s.cuda_graph_impl is not CudaGraphImpl.FULL_ITERATION:
        return []
    if s.compile_mode in _GRAPHED_COMPILE_MODES:
        return [
            f"--compile mode {s.compile_mode} uses its own CUDA graphs, which cannot nest inside "
            f"--cuda-graph-impl full_iteration; allowed modes: {', '.join(GRAPHABLE_COMPILE_MODES)}"
        ]
    return []


def graph_config_problems(settings: GraphSettings) -> list[str]:
    """Every violated rule as a one-line reason (empty list: the combination is valid)."""
    return [
        *_impl_problems(settings),
        *_recompute_problems(settings),
        *_host_sync_problems(settings),
        *_compile_problems(settings),
    ]


def check_graph_config(settings: GraphSettings) -> None:
    """Raise ``ValueError`` listing every violated rule; return None when valid."""
    problems = graph_config_problems(settings)
    if problems:
        raise ValueError("invalid CUDA graph configuration: " + "; ".join(problems))
