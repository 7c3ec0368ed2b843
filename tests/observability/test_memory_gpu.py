"""Theoretical vs measured peak memory on a CUDA device (run on the device machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from stalwart.models import GPT
from stalwart.observability.memory import measured_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = [
    ("tiny", {}),
    ("small", {}),
    ("gpt2-124m", {}),
    ("small", {"dropout": 0.1}),
    ("small", {"num_experts": 4, "moe_router_topk": 2}),
    ("llama-tiny", {}),
    ("llama-150m", {}),
    (
        "llama-150m",
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    ),
    ("gpt2-124m", {"recompute_granularity": "selective"}),
    pytest.param("gpt2-124m", {"cross_entropy_loss_fusion": True}, id="gpt2-124m-fused-loss"),
    pytest.param("llama-150m", {"cross_entropy_loss_fusion": True}, id="llama-150m-fused-loss"),
]


def _peak_bytes(model: GPT, micro_batch: int, num_micro: int, bf16: bool) -> float:
    device = torch.device("cuda")
    cfg = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for it in range(2):
        if it == 1:  # optimizer state exists from here on, as in the trainer's memory report
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=True)
        for _ in range(num_micro):
            ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                out = model(ids, ids)
            assert isinstance(out, dict)
            (out["loss"] / num_micro).backward()
        opt.step()
    torch.cuda.synchronize()
    return measured_memory(device)["mem-max-allocated-bytes"]


def _ratio_in_fresh_process(preset: str, overrides: dict, bf16: bool) -> float:
    """Peak memory is per process: earlier GPU tests' allocations would inflate it, so measure in
    a fresh interpreter (as the trainer's memory report does at the start of a run)."""
    script = (
        "import sys, torch, json\n"
        "sys.path.insert(0, 'tests/observability')\n"
        "from test_memory_gpu import _peak_bytes\n"
        "from stalwart.models import GPT, preset_model_config\n"
        "from stalwart.models.memory_model import theoretical_memory\n"
        f"cfg = preset_model_config({preset!r}, **{overrides!r})\n"
        "torch.manual_seed(0)\n"
        "model = GPT(cfg).cuda().train()\n"
        f"peak = _peak_bytes(model, micro_batch=8, num_micro=4, bf16={bf16})\n"
        f"est = theoretical_memory(cfg, 8, 1, bf16={bf16}, num_parameters=model.num_parameters())\n"
        "print(json.dumps({'ratio': est.total_bytes / peak, 'peak_mib': peak / 2**20,"
        " 'estimate_mib': est.total_bytes / 2**20}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{preset} {overrides} bf16={bf16}: {result}")
    return float(result["ratio"])


@pytest.mark.parametrize(("preset", "overrides"), CASES)
@pytest.mark.parametrize("bf16", [True, False])
def test_theoretical_within_15_percent(preset: str, overrides: dict, bf16: bool) -> None:
    ratio = _ratio_in_fresh_process(preset, overrides, bf16)
    assert 0.85 <= ratio <= 1.15
