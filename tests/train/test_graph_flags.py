"""Graph flags in the trainer: checked before any set-up, one line and exit 2 on CPU."""

from __future__ import annotations

import pytest

from stalwart.cli.main import main
from stalwart.loop import EagerPlan, GraphPlan
from stalwart.train.build import check_inprocess_with_graphs

from train_utils import TINY_FLAGS, make_config


@pytest.mark.parametrize(
    "flags",
    [["--optimizer-cuda-graph"], ["--cuda-graph-impl", "full_iteration"]],
)
def test_graph_flags_on_cpu_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["train", *TINY_FLAGS, "--train-iters", "1", *flags]))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "requires a CUDA device" in err and flags[0] in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_optimizer_graph_alone_is_an_optimizer_graph_over_an_eager_forward_backward() -> None:
    assert make_config().graphs.build() == EagerPlan()
    plan = make_config("--optimizer-cuda-graph").graphs.build()
    assert plan == GraphPlan(full_iteration=False, optimizer_graph=True, warmup_steps=3)


def test_inprocess_restart_of_a_graphed_nccl_job_is_refused() -> None:
    both = make_config(
        "--inprocess-restart", "--save", "/tmp/x", "--cuda-graph-impl", "full_iteration"
    )
    with pytest.raises(ValueError, match="--inprocess-restart with --cuda-graph-impl"):
        check_inprocess_with_graphs(both, "cuda", 2)
    check_inprocess_with_graphs(both, "cuda", 1)  # one rank: no communicator to abort
    check_inprocess_with_graphs(both, "cpu", 2)
    check_inprocess_with_graphs(make_config("--inprocess-restart", "--save", "/tmp/x"), "cuda", 2)
