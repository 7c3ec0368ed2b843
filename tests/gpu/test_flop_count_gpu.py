"""FLOPs counted on the GPU (torch's CUDA attention kernels) agree with the analytic GPT formula
within 5%, as on the CPU, and the count is the same on both devices."""

from __future__ import annotations

import pytest
import torch

from stalwart.models import GPT, num_floating_point_operations, preset_model_config
from stalwart.observability.flop_count import count_training_flops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("preset", ["gpt2-124m", "llama-150m"])
def test_gpu_count_matches_the_formula_and_the_cpu_count(preset: str) -> None:
    config = preset_model_config(preset)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length))
    counts = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = GPT(config).to(device)
        batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            counts[device] = count_training_flops(
                model, lambda b, m: m(b["input_ids"], b["labels"])["loss"], batch
            ).per_microbatch
    analytic = num_floating_point_operations(config, 2)
    assert abs(counts["cuda"] / analytic - 1) < 0.05, (counts, analytic)
    assert abs(counts["cuda"] / counts["cpu"] - 1) < 0.01, counts
