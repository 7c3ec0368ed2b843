"""A start refused while the shell is built (``--profile`` without the PyTorch profiler on a
CPU; a memory interval that is not a multiple of the log interval) leaves nothing behind on
every path: no goodput line, no session in ``goodput.jsonl``, no run directory (the CLI does
not announce one it never creates), one line naming the setting as that path spells it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from stalwart.cli.main import main  # noqa: E402
from stalwart.integrations import hf, lightning  # noqa: E402
from stalwart.loop import Names, ShellConfig  # noqa: E402
from stalwart.observability.memory import MemoryConfig  # noqa: E402
from stalwart.observability.profiler import ProfilerConfig  # noqa: E402
from stalwart.observability.train_log import LogConfig  # noqa: E402

from train_utils import TINY_FLAGS  # noqa: E402

REFUSALS = {
    "profile": ({"profiler": ProfilerConfig(profile=True)}, "profiler.profile"),
    "memory": (
        {"memory": MemoryConfig(log_memory_interval=3), "log": LogConfig(log_interval=2)},
        "memory.log_memory_interval",
    ),
}


def _trainer(run: Path, fields: dict[str, Any]) -> None:
    argv = ["--profile"] if "profiler" in fields else ["--log-memory-interval", "3"]
    argv += ["--log-interval", "2"] if "log" in fields else []
    code = main(["train", *TINY_FLAGS, "--train-iters", "2", "--run-dir", str(run), *argv])
    if code == 2:
        raise ValueError("refused")


def _lightning(run: Path, fields: dict[str, Any]) -> None:
    from test_lightning import TinyLlama, _loader

    callback = lightning.StalwartCallback(str(run), **fields)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLlama(), _loader())


def _hf(run: Path, fields: dict[str, Any]) -> None:
    from test_hf_trainer import Tokens, _model

    callback = hf.StalwartCallback(**fields)
    args = transformers.TrainingArguments(
        str(run),
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    hf.StalwartTrainer(
        model=_model(), args=args, train_dataset=Tokens(), callbacks=[callback]
    ).train()


def _loop(run: Path, fields: dict[str, Any]) -> None:
    with ShellConfig(train_iters=2, save_dir=str(run), **fields).build() as shell:
        model = torch.nn.Linear(2, 1)
        shell.step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda b, m: m(b).sum(), [])


PATHS = {
    "trainer": (_trainer, Names.CLI),
    "lightning": (_lightning, Names.LIGHTNING),
    "hf": (_hf, Names.HF),
    "loop": (_loop, Names.LOOP),
}


@pytest.mark.parametrize("refusal", REFUSALS)
@pytest.mark.parametrize("path", PATHS)
def test_a_refused_start_leaves_nothing_behind(
    path: str, refusal: str, tmp_path: Path, capsys: Any
) -> None:
    run, (fields, setting) = tmp_path / "run", REFUSALS[refusal]
    body, names = PATHS[path]
    with pytest.raises(ValueError) as info:
        body(run, fields)
    out, err = capsys.readouterr()
    message = err.strip().splitlines()[-1] if path == "trainer" else str(info.value)
    assert "\n" not in message and re.search(re.escape(names.spell(setting)), message), message
    assert not (run / "goodput.jsonl").exists() and "goodput" not in out, out[-2000:]
    assert not run.exists() or path == "hf", sorted(run.rglob("*"))  # hf: the Trainer's own
    assert "run directory" not in out  # the CLI announces none
