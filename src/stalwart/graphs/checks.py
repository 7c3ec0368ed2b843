"""Configuration checks for CUDA graphs x recompute x offload x host-syncing checks x compile.

``graph_config_problems`` is a pure decision function returning every violated rule as a
one-line reason naming the offending flag (Megatron spelling); ``check_graph_config`` raises one
``ValueError`` listing them. Rules follow Megatron's ``TransformerConfig``/``arguments.py`` checks,
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
    """``--cuda-graph-impl``: stalwart implements ``none`` and ``full_iteration``."""

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
    cuda_graph_modules: tuple[str, ...] = ()  # also the deprecated --cuda-graph-scope
    enable_cuda_graph: bool = False  # deprecated per-layer switch
    cuda_graph_warmup_steps: int = 3
    optimizer_cuda_graph: bool = False
    optimizer: str = "adam"
    recompute_granularity: RecomputeChoice | None = None  # None: no recompute
    recompute_modules: tuple[str, ...] = ()
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # The flags that set the two dropouts, as messages name them: a caller with one dropout
    # for both (stalwart's trainer: --hidden-dropout) passes its flag for both.
    attention_dropout_flag: str = "--attention-dropout"
    hidden_dropout_flag: str = "--hidden-dropout"
    has_moe: bool = False  # the layers' MLP is a mixture of experts ('moe', else 'mlp')
    moe_input_jitter_eps: float | None = None
    cpu_offloading: bool = False
    fine_grained_activation_offloading: bool = False
    fine_grained_offloading_max_inflight_offloads: int | None = None
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    log_num_zeros_in_grad: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # None with --fp16: dynamic loss scaling
    compile: bool = False
    compile_mode: str = "default"


def _impl_problems(s: GraphSettings) -> list[str]:
    problems: list[str] = []
    full = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION
    if s.cuda_graph_impl in (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE):
        problems.append(
            f"--cuda-graph-impl {s.cuda_graph_impl.value} (per-layer graphs) is not implemented "
            "by stalwart; allowed: none, full_iteration"
        )
    if full and (s.cuda_graph_modules or s.enable_cuda_graph):
        problems.append(
            "--cuda-graph-modules/--cuda-graph-scope/--enable-cuda-graph (per-module graphs) "
            "cannot be combined with --cuda-graph-impl full_iteration: the whole iteration is "
            "one graph"
        )
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
    problems: list[str] = []
    full = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION
    per_layer = (
        s.enable_cuda_graph
        or bool(s.cuda_graph_modules)
        or s.cuda_graph_impl
        in (
            CudaGraphImpl.LOCAL,
            CudaGraphImpl.TRANSFORMER_ENGINE,
        )
    )
    granularity = "none" if s.recompute_granularity is None else s.recompute_granularity.value
    if granularity == "full" and per_layer and not full:
        problems.append(
            "--recompute-granularity full is only supported with --cuda-graph-impl full_iteration "
            "(not with per-layer CUDA graphs)"
        )
    if not full or granularity == "none":
        return problems
    modules = (
        ("core_attn", "moe" if s.has_moe else "mlp")
        if granularity == "full"
        else s.recompute_modules
    )
    problems.extend(_random_recompute_problems(s, modules))
    if s.moe_input_jitter_eps and ("moe" in modules):
        problems.append(
            "--moe-input-jitter-eps is not allowed with recomputed 'moe' inside a full_iteration "
            "CUDA graph: recompute's RNG save/restore cannot be captured"
        )
    return problems


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


def _offload_problems(s: GraphSettings) -> list[str]:
    problems: list[str] = []
    full = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION
    graphs_on = s.cuda_graph_impl is not CudaGraphImpl.NONE or s.enable_cuda_graph
    if s.cpu_offloading and graphs_on and not full:
        problems.append(
            "--cpu-offloading with CUDA graphs requires --cuda-graph-impl full_iteration"
        )
    if s.fine_grained_activation_offloading and graphs_on:
        if not full:
            problems.append(
                "--fine-grained-activation-offloading with CUDA graphs requires "
                "--cuda-graph-impl full_iteration"
            )
        max_inflight = s.fine_grained_offloading_max_inflight_offloads
        if full and (
            isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 0
        ):
            problems.append(
                "--fine-grained-activation-offloading with full_iteration requires "
                "--fine-grained-offloading-max-inflight-offloads to be an integer >= 0, got "
                f"{max_inflight!r}"
            )
    return problems


def _host_sync_problems(s: GraphSettings) -> list[str]:
    problems: list[str] = []
    if s.optimizer_cuda_graph:
        if s.log_num_zeros_in_grad:
            problems.append(
                "--log-num-zeros-in-grad syncs with the host inside the optimizer step; it cannot "
                "be used with --optimizer-cuda-graph"
            )
        if s.optimizer not in ("adam", "adamw"):
            problems.append(
                f"--optimizer-cuda-graph requires --optimizer adam (capturable AdamW), got "
                f"--optimizer {s.optimizer}"
            )
    graphs = s.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION or s.optimizer_cuda_graph
    if graphs and s.fp16 and s.loss_scale is None:
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
        *_offload_problems(settings),
        *_host_sync_problems(settings),
        *_compile_problems(settings),
    ]


def check_graph_config(settings: GraphSettings) -> None:
    """Raise ``ValueError`` listing every violated rule; return None when valid."""
    problems = graph_config_problems(settings)
    if problems:
        raise ValueError("invalid CUDA graph configuration: " + "; ".join(problems))
