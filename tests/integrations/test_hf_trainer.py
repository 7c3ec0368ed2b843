"""The Hugging Face ``Trainer`` with stalwart's callback and ``StalwartTrainer``, on a tiny
``LlamaForCausalLM`` (one CPU process): the log line, TensorBoard keys and goodput appear;
SIGTERM saves ``checkpoint-N`` and the resume is bitwise the uninterrupted run; an injected
persistent fault exits 16 with a checkpoint and the relaunch on another device exits 17."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from stalwart.integrations.hf import StalwartCallback, StalwartTrainer  # noqa: E402
from stalwart.observability.sinks import SinkConfig  # noqa: E402
from stalwart.observability.train_log import LogConfig  # noqa: E402
from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig  # noqa: E402

STEPS, VOCAB, SEQ = 5, 64, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (64, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SigtermAt(transformers.TrainerCallback):
    """What a scheduler does before a preemption: SIGTERM during step ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _train(out: Path, *extra: Any, resume: bool = False, **shell: Any) -> tuple[Any, Any]:
    callback = StalwartCallback(log=LogConfig(log_interval=1, log_throughput=True), **shell)
    args = transformers.TrainingArguments(
        str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="no", report_to=[], use_cpu=True, seed=3, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = StalwartTrainer(
        model=_model(), args=args, train_dataset=Tokens(), callbacks=[callback, *extra]
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer, callback


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_log_tensorboard_sigterm_resume_is_exact(tmp_path: Path, capsys: Any) -> None:
    tb = tmp_path / "tb"
    full, callback = _train(tmp_path / "full", sinks=SinkConfig(tensorboard_dir=str(tb)))
    assert callback.exit_code == 0
    printed = capsys.readouterr().out
    assert f"iteration {STEPS}/{STEPS} | lm loss " in printed  # the compact line
    assert " TFLOP/s/GPU | " in printed  # counted once by torch's counter
    assert "goodput" in printed
    metrics = [
        json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [m["iteration"] for m in metrics if "lm loss" in m] == list(range(1, STEPS + 1))
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
    _, stopped = _train(save, SigtermAt(3))
    assert stopped.exit_code == 0
    assert json.loads((save / "exit_reason.json").read_text())["reason"] == "signal"
    assert (save / "checkpoint-3" / "stalwart_state_rank0.pt").is_file()
    resumed, callback = _train(save, resume=True)
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
            _train(tmp_path / "out", resume=True, rerun=rerun)
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


def test_callback_alone_on_a_plain_trainer_saves_and_stops_on_sigterm(
    tmp_path: Path, capsys: Any
) -> None:
    """No subclass: no rerun machine, but sections, the exit, the log line and goodput."""
    callback = StalwartCallback(log=LogConfig(log_interval=1))
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=Tokens(), callbacks=[callback, SigtermAt(2)]
    )
    trainer.train()
    assert callback.exit_code == 0
    assert trainer.state.global_step == 2
    assert (tmp_path / "checkpoint-2").is_dir()
    assert json.loads((tmp_path / "exit_reason.json").read_text())["reason"] == "signal"
    out = capsys.readouterr().out
    assert f"iteration 2/{STEPS} |" in out and "goodput" in out


def test_after_17_the_suspect_device_is_refused_and_other_hardware_trains_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The way forward after an exit 17 in the Trainer's layout (``checkpoint-N``, N the
    completed iterations: the rejected one is not a step): the verdict names the checkpoint it
    saved, the suspect device is refused (16, one line) and a launch elsewhere trains on to
    ``max_steps``."""
    out = tmp_path / "out"
    tracker = str(tmp_path / "t.txt")
    rerun = RerunConfig(
        error_injection_rate=1, error_injection_type="persistent_error",
        error_injection_iterations=[3], result_rejected_tracker_filename=tracker,
    )  # fmt: skip
    for device, code in (("gpu-a", 16), ("gpu-b", 17)):
        monkeypatch.setenv(DEVICE_ID_ENV, device)
        with pytest.raises(SystemExit) as info:
            _train(out, resume=True, rerun=rerun)
        assert info.value.code == code
    verdict = json.loads((out / "rerun_verdict.json").read_text())
    assert verdict["checkpoint"] == "checkpoint-2" and (out / verdict["checkpoint"]).is_dir()
    capsys.readouterr()
    healthy = RerunConfig(result_rejected_tracker_filename=tracker)  # no bad device any more
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    with pytest.raises(SystemExit) as info:
        _train(out, resume=True, rerun=healthy)
    assert info.value.code == 16
    refusal = [x for x in capsys.readouterr().out.splitlines() if "rerun verdict" in x]
    assert len(refusal) == 1 and "persistent error at iteration 3" in refusal[0], refusal
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-c")
    trainer, callback = _train(out, resume=True, rerun=healthy)
    assert callback.exit_code == 0
    reason = json.loads((out / "exit_reason.json").read_text())
    assert (reason["exit_code"], reason["iteration"]) == (0, STEPS)
    assert trainer.state.global_step == STEPS


class Padded(Tokens):
    """Labels padded with -100 at different lengths: ``num_items_in_batch`` decides the loss."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[SEQ - 1 - i % (SEQ - 2) :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def test_logged_loss_and_grad_norm_are_the_plain_trainers(tmp_path: Path) -> None:
    """What the Trainer logs (its ``log_history``: loss, grad_norm) equals a plain Trainer's
    run of the same model and data, step by step (the first at the very same weights)."""

    def logged(trainer_class: Any, *callbacks: Any) -> list[tuple[float, float]]:
        args = transformers.TrainingArguments(
            str(tmp_path / trainer_class.__name__), max_steps=4, per_device_train_batch_size=4,
            learning_rate=1e-2, max_grad_norm=0.5, save_strategy="no", report_to=[],
            use_cpu=True, seed=3, logging_steps=1, disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_class(
            model=_model(), args=args, train_dataset=Padded(), callbacks=list(callbacks)
        )
        trainer.train()
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    plain = logged(transformers.Trainer)
    guarded = logged(StalwartTrainer, StalwartCallback(log=LogConfig(log_interval=1)))
    assert len(plain) == 4 and all(norm > 0.5 for _, norm in plain[:1])
    assert guarded[0] == plain[0]  # the same weights: the same loss and norm, to the bit
    flat = [value for pair in plain for value in pair]
    assert [value for pair in guarded for value in pair] == pytest.approx(flat, rel=1e-5)


def test_a_transient_fault_under_continue_costs_one_replay_and_ends_bitwise(
    tmp_path: Path,
) -> None:
    """``RerunConfig(rerun_transient_policy="continue")``: the injected transient at step 3
    (the loss's NaN check, a fatal one) does not exit; the rerun's result is applied and the
    weights equal the fault-free run's (dropout draws included: the rerun restores the RNG)."""
    clean, _ = _train(tmp_path / "clean", rerun=RerunConfig())
    rerun = RerunConfig(
        error_injection_rate=1,
        error_injection_type="transient_error",
        error_injection_iterations=[3],
        rerun_transient_policy="continue",
        result_rejected_tracker_filename=str(tmp_path / "t.txt"),
    )
    faulty, callback = _train(tmp_path / "faulty", rerun=rerun)
    assert callback.exit_code == 0 and faulty.state.global_step == STEPS
    assert "status=first_rerun_not_reproducible" in (tmp_path / "t.txt").read_text()
    expected, got = _params(clean), _params(faulty)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
