"""The peer replay's determinism on a GPU: a clean replay of a micro-batch under
``ReplayDeterminism`` (on this GPU: one GPU stands for "another GPU of the same model") matches
the training pass within the machine's tolerances (loss exact, gradients 0.1%).

Run by ``scripts/gpu_check.sh`` (step ``gpu_tests``) on the device machine; prints the figures.
"""

from __future__ import annotations

import pytest
import torch

from stalwart.models import GPT, preset_model_config
from stalwart.reliability.rerun import ReplayDeterminism, capture_rng_state, restore_rng_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pass(model: GPT, tokens: torch.Tensor) -> tuple[float, list[float]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(tokens[:, :-1], tokens[:, 1:])
    assert isinstance(out, dict)
    out["loss"].backward()
    norms = [p.grad.float().norm().item() for p in model.parameters() if p.grad is not None]
    return out["loss"].item(), norms


@pytest.mark.parametrize("preset", ["gpt2-124m"])
def test_clean_replay_under_replay_determinism_is_within_tolerance(preset: str) -> None:
    torch.manual_seed(0)
    config = preset_model_config(preset)
    model = GPT(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_length + 1), device="cuda")
    _pass(model, tokens)  # warm-up: kernels chosen, caches filled
    rng = capture_rng_state()
    loss, norms = _pass(model, tokens)  # the training pass, training settings
    results = []
    for settings in (ReplayDeterminism(), ReplayDeterminism(sdpa_backends=("flash_attention",))):
        restore_rng_state(rng)
        with settings.applied():
            results.append((settings, *_pass(model, tokens)))
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the replay
    for settings, replay_loss, replay_norms in results:
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(norms, replay_norms))
        print(
            f"{preset} replay under {settings}: loss {loss!r} vs {replay_loss!r}, worst "
            f"relative gradient-norm difference {worst:.3e} over {len(norms)} tensors"
        )
        if not settings.sdpa_backends:  # the default: what the machine compares with
            assert replay_loss == loss  # the loss check's tolerance is 0
            assert worst <= 1e-3  # the gradient checks' 0.1%
