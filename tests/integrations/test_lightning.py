"""Lightning 2.x with stalwart's callback and ``GuardedModule`` on a tiny Hugging Face
``LlamaForCausalLM`` (one CPU process): the log line, TensorBoard keys and goodput appear;
SIGTERM saves through ``trainer.save_checkpoint`` and the resume is bitwise the uninterrupted
run; an injected persistent fault exits 16 with a checkpoint, the relaunch on another device 17."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from stalwart.integrations.lightning import (  # noqa: E402
    GuardedModule,
    StalwartCallback,
    latest_checkpoint,
)
from stalwart.integrations.resumable import ResumableLoader  # noqa: E402
from stalwart.observability.sinks import SinkConfig  # noqa: E402
from stalwart.observability.train_log import LogConfig  # noqa: E402
from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig  # noqa: E402

STEPS, VOCAB, SEQ = 5, 64, 8


class TinyLlama(GuardedModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
            attention_dropout=0.1,
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)

    def forward_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SigtermAt(L.Callback):
    """What a scheduler does before a preemption: SIGTERM during step ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _loader() -> ResumableLoader:
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row} for row in ids]
    return ResumableLoader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=False))


def _fit(save: Path, *extra: Any, **shell: Any) -> tuple[TinyLlama, StalwartCallback]:
    callback = StalwartCallback(str(save), log=LogConfig(log_interval=1, log_throughput=True),
                                **shell)  # fmt: skip
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[callback, *extra],
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = TinyLlama()
    trainer.fit(module, _loader(), ckpt_path=latest_checkpoint(str(save)), weights_only=True)
    return module, callback


def _params(module: TinyLlama) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_log_tensorboard_sigterm_resume_is_exact(tmp_path: Path, capsys: Any) -> None:
    tb = tmp_path / "tb"
    full, callback = _fit(tmp_path / "full", sinks=SinkConfig(tensorboard_dir=str(tb)))
    assert callback.exit_code == 0
    printed = capsys.readouterr().out
    assert f"iteration {STEPS}/{STEPS} | lm loss " in printed  # the compact line
    assert " TFLOP/s/GPU | " in printed and "goodput" in printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "lm loss",  # Megatron's flat names (--group-metric-tags: loss/lm loss)
        "learning-rate",
        "grad-norm",
        "goodput",
    } <= tags

    save = tmp_path / "sig"
    _, stopped = _fit(save, SigtermAt(3))
    assert stopped.exit_code == 0
    assert json.loads((save / "exit_reason.json").read_text())["reason"] == "signal"
    assert latest_checkpoint(str(save)) == str(save / "iter_0000003.ckpt")
    resumed, callback = _fit(save)
    assert callback.exit_code == 0
    expected, got = _params(full), _params(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_injected_fault_exits_16_then_17_on_another_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rerun = RerunConfig(
        error_injection_rate=1, error_injection_type="persistent_error",
        error_injection_iterations=[3], result_rejected_tracker_filename=str(tmp_path / "t.txt"),
    )  # fmt: skip
    codes = []
    for device in ("gpu-a", "gpu-b"):
        monkeypatch.setenv(DEVICE_ID_ENV, device)
        with pytest.raises(SystemExit) as info:
            _fit(tmp_path / "out", rerun=rerun)
        codes.append(info.value.code)
        reason = json.loads((tmp_path / "out" / "exit_reason.json").read_text())
        assert reason["iteration"] == 2, reason  # the completed ones, as on every path
    assert codes == [16, 17]
    lines = (tmp_path / "t.txt").read_text().splitlines()
    assert [(line.split(" device=")[1].split()[0], line.split(" status=")[1].split()[0])
            for line in lines] == [
        ("gpu-a", "initial_run"), ("gpu-a", "first_rerun_reproducible"),
        ("gpu-b", "second_rerun_not_reproducible"),
    ]  # fmt: skip
    assert json.loads((tmp_path / "out" / "exit_reason.json").read_text())["exit_code"] == 17


def test_after_17_the_suspect_device_is_refused_and_other_hardware_trains_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The way forward after an exit 17 in Lightning's layout (``iter_NNNNNNN.ckpt``): the
    verdict names the checkpoint the callback saved, the suspect device is refused (16, one
    line) and a launch elsewhere trains on from it to ``max_steps`` (exit 0)."""
    out = tmp_path / "out"
    tracker = str(tmp_path / "t.txt")
    rerun = RerunConfig(
        error_injection_rate=1, error_injection_type="persistent_error",
        error_injection_iterations=[3], result_rejected_tracker_filename=tracker,
    )  # fmt: skip
    for device, code in (("gpu-a", 16), ("gpu-b", 17)):
        monkeypatch.setenv(DEVICE_ID_ENV, device)
        with pytest.raises(SystemExit) as info:
            _fit(out, rerun=rerun)
        assert info.value.code == code
    verdict = json.loads((out / "rerun_verdict.json").read_text())
    assert verdict["checkpoint"] == "iter_0000002.ckpt" and (out / verdict["checkpoint"]).is_file()
    capsys.readouterr()
    healthy = RerunConfig(result_rejected_tracker_filename=tracker)  # no bad device any more
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    with pytest.raises(SystemExit) as info:
        _fit(out, rerun=healthy)
    assert info.value.code == 16
    refusal = [x for x in capsys.readouterr().out.splitlines() if "rerun verdict" in x]
    assert len(refusal) == 1 and "persistent error at iteration 3" in refusal[0], refusal
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-c")
    module, callback = _fit(out, rerun=healthy)
    assert callback.exit_code == 0
    reason = json.loads((out / "exit_reason.json").read_text())
    assert (reason["exit_code"], reason["iteration"]) == (0, STEPS)
    assert module.trainer.global_step == STEPS


def _fit_module(module: Any, tmp_path: Path) -> None:
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[StalwartCallback(str(tmp_path))],
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader())


def test_a_module_the_guarded_step_cannot_drive_is_refused_in_one_line(tmp_path: Path) -> None:
    """Keeping ``training_step`` (it would spin: manual optimization never steps), two
    optimizers, and ``GuardedModule`` after ``LightningModule`` in the bases."""

    class KeepsTrainingStep(TinyLlama):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.forward_step(batch)

    class TwoOptimizers(TinyLlama):
        def configure_optimizers(self) -> Any:
            half = len(list(self.parameters())) // 2
            params = list(self.parameters())
            return [torch.optim.SGD(params[:half], lr=0.1), torch.optim.SGD(params[half:], lr=0.1)]

    with pytest.raises(
        TypeError, match=r"^KeepsTrainingStep defines training_step: .*forward_step"
    ):
        _fit_module(KeepsTrainingStep(), tmp_path / "a")
    with pytest.raises(ValueError, match=r"^TwoOptimizers.configure_optimizers returned 2 "):
        _fit_module(TwoOptimizers(), tmp_path / "b")
    with pytest.raises(TypeError, match=r"put GuardedModule before LightningModule") as info:

        class WrongOrder(L.LightningModule, GuardedModule):  # type: ignore[misc]
            pass

    assert "\n" not in str(info.value) and "(GuardedModule, L.LightningModule)" in str(info.value)


def test_a_transient_fault_under_continue_costs_one_replay_and_ends_bitwise(
    tmp_path: Path,
) -> None:
    """``RerunConfig(rerun_transient_policy="continue")``: the injected transient at step 3
    (the loss's NaN check, a fatal one) does not exit; the rerun's result is applied and the
    weights equal the fault-free run's (dropout draws included: the rerun restores the RNG)."""
    clean, _ = _fit(tmp_path / "clean", rerun=RerunConfig())
    rerun = RerunConfig(
        error_injection_rate=1,
        error_injection_type="transient_error",
        error_injection_iterations=[3],
        rerun_transient_policy="continue",
        result_rejected_tracker_filename=str(tmp_path / "t.txt"),
    )
    faulty, callback = _fit(tmp_path / "faulty", rerun=rerun)
    assert callback.exit_code == 0 and faulty.trainer.global_step == STEPS
    assert "status=first_rerun_not_reproducible" in (tmp_path / "t.txt").read_text()
    expected, got = _params(clean), _params(faulty)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
