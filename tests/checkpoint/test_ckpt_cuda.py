"""CUDA: async save stages through pinned host memory; the GPU keeps training meanwhile."""

from __future__ import annotations

import logging

import pytest
import torch
from ckpt_fixtures import assert_same, make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointManager, read_tracker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _to_cpu(snap: dict) -> dict:
    out = {"params": {k: v.cpu() for k, v in snap["params"].items()}}
    out["optim"] = {
        i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in snap["optim"].items()
    }
    return out


def _cuda_model():
    model = make_model().cuda()
    opt = make_optimizer(model)
    return model, opt


def _cuda_train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen).cuda()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_roundtrip(tmp_path, caplog, async_save: bool) -> None:
    caplog.set_level(logging.INFO, logger="stalwart.checkpoint")
    model, opt = _cuda_model()
    _cuda_train(model, opt, 2, seed=1)
    mgr = CheckpointManager(str(tmp_path), async_save=async_save)
    mgr.save(4, model, opt, {"it": 4}, {"cuda_rng": torch.cuda.get_rng_state()})
    expected = snapshot(model, opt)
    _cuda_train(model, opt, 1, seed=2)  # must not leak into the checkpoint
    torch.cuda.synchronize()
    mgr.close()
    assert read_tracker(str(tmp_path)) == 4
    if async_save:
        modes = [
            r.getMessage() for r in caplog.records if "async checkpoint save:" in r.getMessage()
        ]
        assert modes, caplog.text
        try:
            from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
        except ImportError:
            pass
        else:
            assert "pinned" in modes[0], modes

    model2, opt2 = _cuda_model()
    _cuda_train(model2, opt2, 1, seed=3)
    CheckpointManager(str(tmp_path)).load(model2, opt2)
    assert_same(expected, snapshot(model2, opt2))

    cpu_model = make_model(seed=5)
    cpu_opt = make_optimizer(cpu_model)
    train_steps(cpu_model, cpu_opt, 1)
    CheckpointManager(str(tmp_path)).load(cpu_model, cpu_opt)  # GPU checkpoint -> CPU model
    assert_same(_to_cpu(expected), snapshot(cpu_model, cpu_opt))
