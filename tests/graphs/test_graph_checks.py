from __future__ import annotations

import dataclasses

import pytest
import torch

from stalwart.graphs import (
    CudaGraphImpl,
    GraphSettings,
    check_graph_config,
    compile_for_graph,
    graph_config_problems,
)
from stalwart.models import RecomputeGranularity

CUDA = torch.device("cuda", 0)
FULL = GraphSettings(device=CUDA, cuda_graph_impl=CudaGraphImpl.FULL_ITERATION)


def _reject(settings: GraphSettings, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_graph_config(settings)


def test_valid_combinations_pass() -> None:
    check_graph_config(FULL)
    check_graph_config(GraphSettings(device=torch.device("cpu")))
    check_graph_config(dataclasses.replace(FULL, optimizer_cuda_graph=True, compile=True))
    # The checks stay on: they run device-side inside the graph, verdicts included.
    check_graph_config(dataclasses.replace(FULL, check_for_nan_in_loss_and_grad=True))
    check_graph_config(
        dataclasses.replace(FULL, check_for_spiky_loss=True, check_for_large_grads=True)
    )
    # Full recompute without dropout is fine inside the full-iteration graph.
    check_graph_config(dataclasses.replace(FULL, recompute_granularity=RecomputeGranularity.FULL))
    # Without graphs, host-syncing checks and dynamic fp16 are not our concern.
    check_graph_config(
        GraphSettings(
            device=CUDA,
            check_for_spiky_loss=True,
            fp16=True,
            compile=True,
            compile_mode="reduce-overhead",
        )
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"device": torch.device("cpu")},
            "--cuda-graph-impl full_iteration requires a CUDA device",
        ),
        ({"cuda_graph_warmup_steps": 0}, "--cuda-graph-warmup-steps must be an integer >= 1"),
        ({"fp16": True}, "--fp16 with dynamic loss scaling is not supported"),
        ({"compile": True, "compile_mode": "reduce-overhead"}, "cannot nest inside"),
        ({"compile": True, "compile_mode": "max-autotune"}, "cannot nest inside"),
        (
            {"recompute_granularity": RecomputeGranularity.FULL, "hidden_dropout": 0.1},
            "--hidden-dropout=0.1 is not allowed with recomputed 'mlp'",
        ),
        (
            {
                "recompute_granularity": RecomputeGranularity.SELECTIVE,
                "recompute_modules": ("core_attn",),
                "attention_dropout": 0.1,
            },
            "--attention-dropout=0.1 is not allowed with recomputed 'core_attn'",
        ),
    ],
)
def test_full_iteration_rejections(change: dict, match: str) -> None:
    _reject(dataclasses.replace(FULL, **change), match)


def test_selective_recompute_of_deterministic_modules_is_allowed() -> None:
    check_graph_config(
        dataclasses.replace(
            FULL,
            recompute_granularity=RecomputeGranularity.SELECTIVE,
            recompute_modules=("core_attn",),
            hidden_dropout=0.1,
        )
    )


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            GraphSettings(device=torch.device("cpu"), optimizer_cuda_graph=True),
            "--optimizer-cuda-graph requires a CUDA device",
        ),
        (
            GraphSettings(device=CUDA, optimizer_cuda_graph=True, log_num_zeros_in_grad=True),
            "--log-num-zeros-in-grad",
        ),
    ],
)
def test_other_rejections(settings: GraphSettings, match: str) -> None:
    _reject(settings, match)


def test_all_problems_are_reported_together() -> None:
    bad = dataclasses.replace(
        FULL, device=torch.device("cpu"), fp16=True, cuda_graph_warmup_steps=0
    )
    assert len(graph_config_problems(bad)) == 3


def test_compile_for_graph_rejects_graphing_modes() -> None:
    with pytest.raises(ValueError, match="reduce-overhead"):
        compile_for_graph(torch.nn.Linear(2, 2), mode="reduce-overhead")


def test_recompute_rules_use_the_models_settings() -> None:
    """The graph rules read the model's real recompute settings (stalwart.models.recompute):
    selective recompute runs the attention core again, full recompute whole layers."""
    from stalwart.models import GPTConfig
    from stalwart.models import RecomputeGranularity as ModelGranularity
    from stalwart.models.recompute import SELECTIVE_RECOMPUTE_MODULES

    assert RecomputeGranularity is ModelGranularity
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        seq_length=4,
        vocab_size=16,
        dropout=0.1,
        recompute_granularity="selective",
    )
    settings = dataclasses.replace(
        FULL,
        recompute_granularity=cfg.recompute_granularity,
        recompute_modules=SELECTIVE_RECOMPUTE_MODULES,
        attention_dropout=cfg.dropout,
        hidden_dropout=cfg.dropout,
    )
    assert graph_config_problems(settings) == [
        "--attention-dropout=0.1 is not allowed with recomputed 'core_attn' inside a "
        "full_iteration CUDA graph: recompute's RNG save/restore cannot be captured (set it to "
        "0, or recompute nothing)"
    ]


def test_any_models_recompute_enum_is_read_by_its_value() -> None:
    """graphs does not import the reference model: another model's enum of the same values
    gets the same verdicts as ``stalwart.models.RecomputeGranularity``."""
    import enum

    class Granularity(enum.Enum):
        NONE = "none"
        FULL = "full"

    ours = dataclasses.replace(FULL, recompute_granularity=RecomputeGranularity.FULL)
    theirs = dataclasses.replace(FULL, recompute_granularity=Granularity.FULL)
    for dropout in (0.0, 0.1):
        a, b = (dataclasses.replace(s, hidden_dropout=dropout) for s in (ours, theirs))
        assert graph_config_problems(a) == graph_config_problems(b)
    assert graph_config_problems(dataclasses.replace(theirs, hidden_dropout=0.1))
    assert not graph_config_problems(
        dataclasses.replace(FULL, recompute_granularity=Granularity.NONE, hidden_dropout=0.1)
    )


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_megatrons_per_layer_graphs_are_refused_in_one_line_saying_why(impl: str) -> None:
    """Megatron's per-layer ``--cuda-graph-impl`` values reach no graph rule: the run's config
    refuses them, naming the flag, why and what is allowed."""
    from stalwart.config.run import GraphConfig

    with pytest.raises(ValueError) as refused:
        GraphConfig(cuda_graph_impl=impl)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"--cuda-graph-impl {impl} (Megatron's per-layer graphs) is not implemented by stalwart, "
        "which graphs the whole iteration; allowed: none, full_iteration"
    )


@pytest.mark.parametrize(
    "flag",
    ["--cuda-graph-modules", "--cuda-graph-scope", "--enable-cuda-graph", "--cpu-offloading",
     "--fine-grained-activation-offloading", "--moe-input-jitter-eps", "--loss-scale"],
)  # fmt: skip
def test_megatrons_other_graph_flags_are_refused_by_the_cli(flag: str) -> None:
    """The Megatron flags GraphSettings no longer carries are refused where they are given."""
    from stalwart.cli.megatron_flags import UNSUPPORTED

    assert flag in {u.flag for u in UNSUPPORTED}


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_the_cli_refuses_megatrons_per_layer_graphs_saying_why(
    impl: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stalwart train --cuda-graph-impl local``: exit 2 and one line naming the flag and why."""
    from stalwart.cli.args import build_train_parser

    with pytest.raises(SystemExit) as exited:
        build_train_parser().parse_args(["--cuda-graph-impl", impl])
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert (
        len(lines) == 1 and f"--cuda-graph-impl: {impl} (Megatron's per-layer graphs)" in lines[0]
    )
