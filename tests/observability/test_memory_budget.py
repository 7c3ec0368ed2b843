"""Will-it-fit: the docstring example of stalwart.observability.memory_budget, on CPU."""

from __future__ import annotations

import pytest
import torch

from stalwart.models import preset_model_config
from stalwart.models.memory_model import theoretical_memory
from stalwart.observability.memory_budget import GIB, available_memory, check_fits

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_docstring_example_on_cpu() -> None:
    cfg = preset_model_config("tiny")
    est = theoretical_memory(cfg, micro_batch_size=8, dp_size=1, workspace_bytes=0)
    available, where = available_memory(torch.device("cpu"), ranks_sharing=1)
    assert available is not None and available > 0 and "GiB available" in where
    check_fits(est.total_bytes, available, where=where, cause="lower --micro-batch-size")
    with pytest.raises(ValueError, match=r"does not fit in memory.*lower --micro-batch-size"):
        check_fits(available * 2, available, where=where, cause="lower --micro-batch-size")


def test_cpu_memory_is_shared_by_the_ranks_of_a_node() -> None:
    one, _ = available_memory(torch.device("cpu"), ranks_sharing=1)
    four, where = available_memory(torch.device("cpu"), ranks_sharing=4)
    assert one is not None and four is not None
    assert four == pytest.approx(one / 4, rel=0.2)  # available memory moves a little meanwhile
    assert "for each of 4 ranks" in where and four < 1024 * GIB


def test_unknown_available_memory_never_refuses() -> None:
    check_fits(1e30, None, where="available memory unknown", cause="x")


@pytest.mark.gpu
@needs_cuda
def test_cuda_free_memory_is_the_budget() -> None:
    device = torch.device("cuda", 0)
    free, where = available_memory(device, ranks_sharing=8)  # GPU memory is not shared
    assert free is not None and 0 < free <= torch.cuda.get_device_properties(0).total_memory
    assert "cuda:0 has" in where and "GiB free" in where


@pytest.mark.gpu
@needs_cuda
def test_cli_refuses_a_micro_batch_that_cannot_fit_on_the_gpu(tmp_path) -> None:
    from train_utils import run_cli

    args = ["train", "--preset", "tiny", "--train-iters", "2", "--save", str(tmp_path / "ckpt")]
    proc = run_cli([*args, "--micro-batch-size", "100000000"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit in memory" in lines[0] and "GiB free" in lines[0]
    assert "--micro-batch-size 100000000" in lines[0]
    assert not (tmp_path / "ckpt").exists()
