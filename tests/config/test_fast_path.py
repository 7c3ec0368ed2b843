"""Compiled full-iteration graphs turn on every same-numerics setting; nothing else changes.

``--compile --cuda-graph-impl full_iteration --optimizer-cuda-graph`` resolves the unset
``--bf16-compute-weights``, ``--gradient-accumulation-fusion``, ``--clip-grad-in-optimizer``,
``--cross-entropy-loss-fusion`` and two Inductor options where the other flags allow them; an
explicit value (``--no-...``, ``--inductor-config KEY=...``) wins; ``--bf16-residual-connection``
(numerics) stays off; runs without that flag set resolve as before.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import stalwart.config.fast_path
from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.config.fast_path import INDUCTOR_OPTIONS
from stalwart.config.inductor import known_inductor_options
from stalwart.config.run import RunConfig, build_run_config

GRAPHS = ["--compile", "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"]
BASE = ["--preset", "tiny", "--bf16"]
KNOWN = known_inductor_options()
EXPECTED_OPTIONS = [f"{k}={v}" for k, v in INDUCTOR_OPTIONS if k in KNOWN]


def _config(*flags: str) -> RunConfig:
    argv = [*BASE, *flags]
    return build_run_config(parse_train_args(argv), argv)


def _switches(config: RunConfig) -> dict[str, bool]:
    return {
        "bf16_compute_weights": config.training.bf16_compute_weights,
        "gradient_accumulation_fusion": config.training.gradient_accumulation_fusion,
        "clip_grad_in_optimizer": config.optim.clip_grad_in_optimizer,
        "cross_entropy_loss_fusion": config.model.cross_entropy_loss_fusion,
    }


def test_compiled_graphs_turn_on_the_same_numerics_set() -> None:
    config = _config(*GRAPHS)
    assert all(_switches(config).values()), _switches(config)
    assert config.training.inductor_config == EXPECTED_OPTIONS
    assert "coordinate_descent_tuning=True" in EXPECTED_OPTIONS
    assert config.model.bf16_residual_connection is False  # the numerics switch: opt-in


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--compile"],
        ["--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph"],
        ["--compile", "--cuda-graph-impl", "full_iteration"],
        ["--compile", "--optimizer-cuda-graph"],
        [*GRAPHS, "--cuda-graph-include-optimizer"],
    ],
    ids=["default", "compile", "graphs", "no-optimizer-graph", "optimizer-graph", "in-graph"],
)
def test_other_runs_resolve_as_before(flags: list[str]) -> None:
    config = _config(*flags)
    assert not any(_switches(config).values()), _switches(config)
    assert not config.training.inductor_config


def test_an_explicit_value_wins() -> None:
    config = _config(
        *GRAPHS,
        "--no-bf16-compute-weights",
        "--no-cross-entropy-loss-fusion",
        "--inductor-config",
        "coordinate_descent_tuning=False",
    )
    got = _switches(config)
    assert got == {
        "bf16_compute_weights": False,
        "gradient_accumulation_fusion": False,  # needs the compute weights: stays off
        "clip_grad_in_optimizer": True,
        "cross_entropy_loss_fusion": False,
    }
    options = config.training.inductor_config or []
    assert options[0] == "coordinate_descent_tuning=False"
    assert "coordinate_descent_tuning=True" not in options
    megatron = _config(*GRAPHS, "--no-gradient-accumulation-fusion", "--no-clip-grad-in-optimizer")
    assert _switches(megatron) == {
        "bf16_compute_weights": True,
        "gradient_accumulation_fusion": False,
        "clip_grad_in_optimizer": False,
        "cross_entropy_loss_fusion": True,
    }


NO_CLIP = {"bf16_compute_weights", "gradient_accumulation_fusion", "cross_entropy_loss_fusion"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(["--fp16"], {"clip_grad_in_optimizer"}), (["--bf16", "--clip-grad", "0"], NO_CLIP)],
    ids=["fp16", "no-clip"],
)
def test_only_where_the_other_flags_allow(flags: list[str], expected: set[str]) -> None:
    argv = ["--preset", "tiny", *flags, *GRAPHS]
    config = build_run_config(parse_train_args(argv), argv)
    assert {k for k, on in _switches(config).items() if on} == expected


def test_fsdp2_keeps_what_it_refuses_off() -> None:
    config = _config(*GRAPHS, "--use-torch-fsdp2")
    assert _switches(config) == {
        "bf16_compute_weights": False,
        "gradient_accumulation_fusion": False,
        "clip_grad_in_optimizer": False,
        "cross_entropy_loss_fusion": True,
    }


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The printed TOML holds the resolved values (a run reads them back as given): the same
    bytes printed again, the same config."""
    assert main(["train", *BASE, *GRAPHS, "--print-config"]) == 0
    first = capsys.readouterr().out
    assert "bf16_compute_weights = true" in first and "clip_grad_in_optimizer = true" in first
    path = tmp_path / "run.toml"
    path.write_text(first)
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    argv = ["--config", str(path)]
    assert build_run_config(parse_train_args(argv), argv) == _config(*GRAPHS)


def test_docstring_example_runs() -> None:
    result = doctest.testmod(stalwart.config.fast_path)
    assert result.attempted > 0 and result.failed == 0
