"""Spike rewind on a hand-written loop (``stalwart.loop.Shell``), one rank, in process.

The data has a poisoned window: the batches of iterations 30 and 31 are scaled by 1000, so their
loss spikes (10x the largest of the first 100 losses, Megatron's sampling window: 4 micro-batches
per iteration fill it by iteration 25). The spike reproduces in the rerun (it is the data), so the
run rewinds to its newest checkpoint (iteration 24), trains 25-29 again and skips 30-31. It ends
bitwise equal to a run whose loader never served the window, and to a run that skipped it with
``iterations_to_skip``; a relaunch from the checkpoint before the window skips it too (the
tracker file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.checkpoint import CheckpointManager
from stalwart.loop import ShellConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

ITERS, MICRO, SAVE_EVERY = 36, 4, 8
WINDOW = (30, 31)  # the poisoned iterations, as logged


def _batches(poisoned: bool = True, served: bool = True) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch of the run in order; ``served=False``: the window's are left out."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for number in range(1, ITERS + 1):
        for _ in range(MICRO):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen)
            if number in range(WINDOW[0], WINDOW[1] + 1):
                if not served:
                    continue
                if poisoned:
                    x, y = x * 1000.0, y * 1000.0
            out.append({"x": x, "y": y})
    return out


def _forward(batch: dict[str, torch.Tensor], model: nn.Module) -> Any:
    noise = 0.01 * torch.randn(batch["y"].shape)  # RNG: the rewind must restore its state
    loss = nn.functional.mse_loss(model(batch["x"]) + noise, batch["y"])
    return {"loss": loss, "lm loss": loss.detach()}


def _rerun(tmp: Path, **fields: Any) -> RerunConfig:
    return RerunConfig(
        check_for_spiky_loss=True,
        result_rejected_tracker_filename=str(tmp / "tracker.txt"),
        **fields,
    )


def _loop(
    save: Path,
    rerun: RerunConfig,
    data: list[dict[str, torch.Tensor]],
    *,
    iters: int = ITERS,
    crash_after_rewind: bool = False,
    save_every: int = SAVE_EVERY,
) -> tuple[list[torch.Tensor], list[str]]:
    """The README's loop; returns the final parameters and what the shell printed."""
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    printed: list[str] = []
    exits = ExitConfig(save_interval=save_every)
    config = ShellConfig(train_iters=iters, save_dir=str(save), rerun=rerun, exit=exits)
    with config.build(print_fn=lambda *a, **k: printed.append(" ".join(map(str, a)))) as shell:
        it_data = RerunDataIterator(data)
        step = shell.step(model, optimizer, _forward, it_data, num_microbatches=MICRO)
        ckpt = shell.checkpointer(CheckpointManager(str(save)), model, optimizer, data=it_data)
        torch.manual_seed(123)  # the noise draws start alike in every run (or come from ckpt)
        shell.start(ckpt)
        while True:
            with shell.iteration() as it:
                result = step.run(it)
            shell.record(result, batch_size=4 * MICRO)
            decision = shell.decide(result)
            if shell.act(decision, ckpt) is not None:
                break
            if crash_after_rewind and decision.rewind is not None:
                break  # the process dies here: nothing saved after the rewind
        ckpt.close()
    return [p.detach().clone() for p in model.parameters()], printed


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def never_served(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The loader never served the window: the run has that many fewer iterations."""
    tmp = tmp_path_factory.mktemp("never")
    skipped = WINDOW[1] - WINDOW[0] + 1
    params, _ = _loop(tmp / "save", _rerun(tmp), _batches(served=False), iters=ITERS - skipped)
    return params


def test_a_poisoned_window_is_skipped_after_a_rewind_and_ends_as_if_never_served(
    tmp_path: Path, never_served: list[torch.Tensor]
) -> None:
    rerun = _rerun(tmp_path, rewind_on_spike=True, rewind_skip_window=2)
    params, printed = _loop(tmp_path / "save", rerun, _batches())
    _same(params, never_served)
    (line,) = [p for p in printed if p.startswith("spike rewind")]
    assert (
        "spike rewind 1 of 3: Spiky loss" in line
        and "at iteration 30 reproduced (in place)" in line
    )
    assert "iter_0000024 (24 iterations); skipping iterations 30-31" in line
    assert [p for p in printed if p.startswith("skipping")] == [
        "skipping iteration 30 (spike rewind)",
        "skipping iteration 31 (spike rewind)",
    ]
    lines = (tmp_path / "tracker.txt").read_text().splitlines()
    skipped = [x for x in lines if "status=rewind_skipped" in x]
    assert [x.split(" iteration=")[1].split()[0] for x in skipped] == ["30", "31"]
    assert all("rewound to iteration 24" in x for x in skipped)

    # The same run with the window in iterations_to_skip from the start: bitwise the same.
    skip = _rerun(tmp_path / "skip", iterations_to_skip=[30, 31])
    (tmp_path / "skip").mkdir()
    _same(_loop(tmp_path / "skip" / "save", skip, _batches())[0], params)


def test_a_relaunch_after_the_rewind_skips_the_window_too(
    tmp_path: Path, never_served: list[torch.Tensor]
) -> None:
    """The process dies right after the rewind (nothing saved since iteration 24): the
    relaunch resumes iteration 24, reads the skipped window from the tracker file, and ends as
    the uninterrupted run; the rewind counts against max_rewinds."""
    rerun = _rerun(tmp_path, rewind_on_spike=True, rewind_skip_window=2, max_rewinds=1)
    _loop(tmp_path / "save", rerun, _batches(), crash_after_rewind=True)
    params, printed = _loop(tmp_path / "save", rerun, _batches())
    _same(params, never_served)
    assert not [p for p in printed if p.startswith("spike rewind")]
    assert "skipping iteration 30 (ShellConfig.rerun.iterations_to_skip)" in printed


def test_a_spike_after_the_last_rewind_trains_on(tmp_path: Path) -> None:
    """max_rewinds reached (by an earlier launch, as the tracker file says): the spike is
    trained on, as without rewinds."""
    (tmp_path / "tracker.txt").write_text(
        "ts=x node=n device=d jobID=1 rank=0 iteration=2 status=rewind_skipped result=1.0 "
        "message='Spiky loss at iteration 2: rewound to iteration 0'\n"
    )
    rerun = _rerun(tmp_path, rewind_on_spike=True, max_rewinds=1)
    without = _rerun(tmp_path / "plain", iterations_to_skip=[2])
    (tmp_path / "plain").mkdir()
    params, printed = _loop(tmp_path / "save", rerun, _batches(), iters=32)
    assert not [p for p in printed if p.startswith("spike rewind")]
    _same(params, _loop(tmp_path / "plain" / "save", without, _batches(), iters=32)[0])


def test_lr_scale_applies_from_the_restored_iteration_and_a_relaunch_scales_alike(
    tmp_path: Path,
) -> None:
    rerun = _rerun(tmp_path / "a", rewind_on_spike=True, rewind_skip_window=2, rewind_lr_scale=0.5)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole, _ = _loop(tmp_path / "a" / "save", rerun, _batches())
    again = _rerun(tmp_path / "b", rewind_on_spike=True, rewind_skip_window=2, rewind_lr_scale=0.5)
    _loop(tmp_path / "b" / "save", again, _batches(), crash_after_rewind=True)
    relaunched, _ = _loop(tmp_path / "b" / "save", again, _batches())
    _same(relaunched, whole)
    unscaled = _rerun(tmp_path / "c", rewind_on_spike=True, rewind_skip_window=2)
    (tmp_path / "c").mkdir()
    plain, _ = _loop(tmp_path / "c" / "save", unscaled, _batches())
    assert not all(torch.equal(x, y) for x, y in zip(whole, plain, strict=True))


def test_a_one_shot_data_iterator_is_refused_in_one_line(tmp_path: Path) -> None:
    config = ShellConfig(
        train_iters=2, save_dir=str(tmp_path), rerun=_rerun(tmp_path, rewind_on_spike=True)
    )
    model = nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with config.build() as shell:
        one_shot = RerunDataIterator(iter(_batches()))
        with pytest.raises(ValueError, match=r"^ShellConfig\.rerun\.rewind_on_spike: the data"):
            shell.step(model, optimizer, _forward, one_shot)
        step = shell.step(model, optimizer, _forward, RerunDataIterator(_batches()))
        assert step is not None
        with pytest.raises(ValueError, match=r"^ShellConfig\.rerun\.rewind_on_spike: a rewind"):
            shell.checkpointer(CheckpointManager(str(tmp_path)), model, optimizer)


def test_rewind_without_the_shell_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^RerunConfig\.rewind_on_spike needs the loop"):
        RerunConfig(
            check_for_spiky_loss=True,
            rewind_on_spike=True,
            result_rejected_tracker_filename="/dev/null",
        ).build("cpu")


def test_with_no_snapshot_yet_the_window_is_skipped_in_place(
    tmp_path: Path, never_served: list[torch.Tensor]
) -> None:
    """The spike comes before the first checkpoint: the machine already put the iteration's
    start back (RNG, loss scale, its micro-batches), so the rewind skips the window from there."""
    rerun = _rerun(tmp_path, rewind_on_spike=True, rewind_skip_window=2)
    params, printed = _loop(tmp_path / "save", rerun, _batches(), save_every=100)
    _same(params, never_served)
    (line,) = [p for p in printed if p.startswith("spike rewind")]
    assert "restored no snapshot yet; skipping iterations 30-31" in line
