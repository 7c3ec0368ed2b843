"""2 gloo ranks save with DDP (sync and async); 1 process without a group loads a plain model."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stalwart.checkpoint import CheckpointManager, read_tracker

from dist_utils import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _snap(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Picklable by value (numpy), so results cross the process boundary safely."""
    return {
        "params": {k: v.detach().numpy().copy() for k, v in module.state_dict().items()},
        "optim": [
            {k: v.numpy().copy() for k, v in s.items() if torch.is_tensor(v)}
            for s in opt.state.values()
        ],
    }


def _body(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for s in range(2):
        _step(ddp, opt, seed=10 * rank + s)  # rank-dependent data, DDP keeps replicas equal
    CheckpointManager(save_dir, keep_last=3).save(2, ddp, opt, {"it": 2}, {"rank": rank})
    snap2 = _snap(ddp.module, opt)
    _step(ddp, opt, seed=99 + rank)
    mgr = CheckpointManager(save_dir, async_save=True)  # collective: creates a gloo group
    mgr.save(3, ddp, opt, {"it": 3}, {"rank": rank})
    snap3 = _snap(ddp.module, opt)
    _step(ddp, opt, seed=7)  # training continues while the write runs
    committed = None
    while committed is None:
        committed = mgr.maybe_finalize()
        time.sleep(0.01)
    mgr.close()
    fresh = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    )
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loaded = CheckpointManager(save_dir).load(fresh, fresh_opt)
    assert loaded is not None and loaded.iteration == 3 and loaded.per_rank == {"rank": rank}
    return {
        "snap2": snap2,
        "snap3": snap3,
        "committed": committed,
        "reload": _snap(fresh.module, fresh_opt),
    }


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k])
    assert len(a["optim"]) == len(b["optim"])
    for sa, sb in zip(a["optim"], b["optim"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_two_ranks_save_single_process_load(tmp_path) -> None:
    save_dir = str(tmp_path)
    results = run_distributed(_body, world_size=2, args=(save_dir,))
    assert [r["committed"] for r in results] == [3, 3]
    _assert_equal(results[0]["snap2"], results[1]["snap2"])
    _assert_equal(results[0]["snap3"], results[0]["reload"])
    _assert_equal(results[1]["snap3"], results[1]["reload"])
    assert read_tracker(save_dir) == 3

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # plain, no group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = CheckpointManager(None, save_dir).load(model, opt, iteration=2)
    assert loaded is not None and loaded.saved_world_size == 2 and loaded.common == {"it": 2}
    assert loaded.per_rank == {"rank": 0}  # rank 0's file exists: handed over with a warning
    _assert_equal(results[0]["snap2"], _snap(model, opt))
    loaded = CheckpointManager(None, save_dir).load(model, opt)
    assert loaded is not None and loaded.iteration == 3
    _assert_equal(results[0]["snap3"], _snap(model, opt))
