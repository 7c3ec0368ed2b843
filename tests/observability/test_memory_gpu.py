"""Theoretical vs measured peak memory on a CUDA device (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from stalwart.models import GPT, preset_model_config
from stalwart.observability.memory import measured_memory, theoretical_memory

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


@pytest.mark.parametrize(("preset", "overrides"), CASES)
@pytest.mark.parametrize("bf16", [True, False])
def test_theoretical_within_15_percent(preset: str, overrides: dict, bf16: bool) -> None:
    cfg = preset_model_config(preset, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).cuda().train()
    peak = _peak_bytes(model, micro_batch=8, num_micro=4, bf16=bf16)
    est = theoretical_memory(cfg, 8, 1, bf16=bf16, num_parameters=model.num_parameters())
    ratio = est.total_bytes / peak
    print(
        f"\n{preset} {overrides} bf16={bf16}: theoretical {est.total_bytes / 2**20:.1f} MiB, "
        f"measured {peak / 2**20:.1f} MiB, ratio {ratio:.3f}; "
        + ", ".join(f"{k}={v / 2**20:.1f}" for k, v in est.breakdown.items())
    )
    del model
    torch.cuda.empty_cache()
    assert 0.85 <= ratio <= 1.15
