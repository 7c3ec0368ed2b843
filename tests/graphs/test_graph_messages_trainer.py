"""The trainer's graphs x recompute refusals name the flag that sets its one dropout
(--hidden-dropout) and the modules the model really recomputes ('mlp' dense, 'moe' MoE)."""

from __future__ import annotations

import pytest
import torch

from stalwart.train.build import check_graph_flags

from train_utils import make_config

FULL = ["--cuda-graph-impl", "full_iteration", "--recompute-granularity", "full"]
FULL += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]


def _message(*flags: str) -> str:
    config = make_config(*FULL, "--hidden-dropout", "0.1", *flags)
    with pytest.raises(ValueError) as info:
        check_graph_flags(config, torch.device("cuda"))
    return str(info.value)


def test_dense_model_names_hidden_dropout_and_mlp_only() -> None:
    message = _message()
    assert "--hidden-dropout=0.1 is not allowed with recomputed 'core_attn', 'mlp'" in message
    assert "--attention-dropout" not in message and "'moe'" not in message
    assert message.count("--hidden-dropout") == 1  # one reason, not one per module


def test_moe_model_names_moe_not_mlp() -> None:
    message = _message("--num-experts", "2")
    assert "recomputed 'core_attn', 'moe'" in message and "'mlp'" not in message


def test_fp16_under_graphs_names_no_flag_the_trainer_lacks() -> None:
    config = make_config("--cuda-graph-impl", "full_iteration", "--fp16")
    with pytest.raises(ValueError) as info:
        check_graph_flags(config, torch.device("cuda"))
    assert "--fp16 with dynamic loss scaling" in str(info.value)
    assert "--loss-scale" not in str(info.value)
