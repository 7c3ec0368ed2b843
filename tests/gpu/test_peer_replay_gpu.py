"""The peer replay's determinism on a GPU: a clean replay of a micro-batch under
``ReplayDeterminism`` (on this GPU: one GPU stands for "another GPU of the same model") matches
the training pass within the machine's tolerances (loss exact, gradients 0.1%).

And, on two GPUs, the peer replay under full-iteration CUDA graphs (NCCL, DDP).

On one GPU, from the repository root (prints the figures; the two-GPU test skips):

    PYTHONPATH=src python3 -m pytest -q -s -rfs -m gpu -p no:cacheprovider tests/gpu/test_peer_replay_gpu.py

(``scripts/gpu_check.sh``: step ``gpu_tests`` with every GPU test, or ``peer_replay_gpu`` alone.)
The CPU form of the comparison (toy sizes, no mark) runs in ``make test``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from stalwart.models import GPT, preset_model_config
from stalwart.reliability.rerun import ReplayDeterminism
from stalwart.rng_state import capture_rng_state, restore_rng_state

from train_utils import run_cli

# The same comparison on CPU at toy sizes: the code path (RNG capture and restore, both settings
# applied and undone, the SDPA pin) runs in every `make test`; the figures are the GPU's.
TOY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 16,
       "vocab_size": 256}  # fmt: skip


def _pass(model: GPT, tokens: torch.Tensor) -> tuple[float, list[float]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        out = model(tokens[:, :-1], tokens[:, 1:])
    assert isinstance(out, dict)
    out["loss"].backward()
    norms = [p.grad.float().norm().item() for p in model.parameters() if p.grad is not None]
    return out["loss"].item(), norms


def _compare_replays(
    preset: str, device: str, batch: int, **overrides: object
) -> list[tuple[ReplayDeterminism, float, float]]:
    """A training pass, then its replay under each setting from the same RNG state:
    ``(settings, replay loss - training loss, worst relative gradient-norm difference)``."""
    torch.manual_seed(0)
    config = preset_model_config(preset, **overrides)
    model = GPT(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1), device=device)
    _pass(model, tokens)  # warm-up: kernels chosen, caches filled
    rng = capture_rng_state()
    loss, norms = _pass(model, tokens)  # the training pass, training settings
    results = []
    for settings in (ReplayDeterminism(), ReplayDeterminism(sdpa_backends=("flash_attention",))):
        restore_rng_state(rng)
        with settings.applied():
            replay_loss, replay_norms = _pass(model, tokens)
        assert len(replay_norms) == len(norms) > 0
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(norms, replay_norms))
        print(
            f"{preset} on {device}, replay under {settings}: loss {loss!r} vs {replay_loss!r}, "
            f"worst relative gradient-norm difference {worst:.3e} over {len(norms)} tensors"
        )
        results.append((settings, replay_loss - loss, worst))
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the replay
    return results


@pytest.mark.parametrize("preset", ["gpt2-124m"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clean_replay_under_replay_determinism_is_within_tolerance(preset: str) -> None:
    for settings, loss_difference, worst in _compare_replays(preset, "cuda", 8):
        if not settings.sdpa_backends:  # the default: what the machine compares with
            assert loss_difference == 0  # the loss check's tolerance is 0
            assert worst <= 1e-3  # the gradient checks' 0.1%


def test_clean_replay_on_cpu_is_exact() -> None:
    for _settings, loss_difference, worst in _compare_replays("tiny", "cpu", 2, **TOY):
        assert loss_difference == 0 and worst == 0  # CPU kernels are deterministic


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_peer_replay_under_full_iteration_graphs_on_two_gpus(tmp_path: Path) -> None:
    """``persistent_error`` on rank 1 after capture (iteration 15): the peer (rank 0) replays
    rank 1's micro-batches in its captured graph; one launch ends with the verdict naming
    rank 1, the saved pre-iteration state and ``suspect_devices.json``."""
    save, tracker = tmp_path / "ckpt", tmp_path / "tracker.txt"
    flags = ["train", "--preset", "tiny", "--bf16", "--train-iters", "20", "--log-interval",
             "1", "--micro-batch-size", "4", "--global-batch-size", "32", "--no-progress-bar",
             "--cuda-graph-impl", "full_iteration", "--optimizer-cuda-graph",
             "--save", str(save), "--result-rejected-tracker-filename", str(tracker),
             "--rerun-peer-replay", "--error-injection-rate", "1", "--error-injection-type",
             "persistent_error", "--error-injection-iterations", "15",
             "--error-injection-ranks", "1"]  # fmt: skip
    proc = run_cli(flags, nproc=2)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)}
    assert 17 in codes and codes <= {17, -15}, log[-3000:]
    assert "Replaying iteration 15 on a peer replica: rank 1 on rank 0" in log, log[-3000:]
    assert "persistent error on rank 1" in log
    suspects = json.loads((save / "suspect_devices.json").read_text())
    assert [s["rank"] for s in suspects["suspects"]] == [1]
    assert suspects["checkpoint"] == "iter_0000014"
    assert "peer_replay_not_reproducible" in tracker.read_text()
