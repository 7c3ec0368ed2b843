"""The adapters in a framework user's eyes (issue 44 item 4): a normal Hugging Face run prints no
torch warning; both adapters log the learning rate the step used; Lightning's progress bar shows
the loss without ``self.log(..., prog_bar=True)``; stalwart's values reach the framework's own
loggers (Lightning's ``trainer.loggers``, the ``logs`` every Hugging Face callback receives)."""

from __future__ import annotations

import csv
import doctest
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_hf_trainer import Tokens, _model  # noqa: E402
from test_lightning import TinyLlama, _loader  # noqa: E402

from stalwart.integrations import offered_metrics  # noqa: E402
from stalwart.integrations.hf import StalwartCallback as HfCallback  # noqa: E402
from stalwart.integrations.hf import StalwartTrainer  # noqa: E402
from stalwart.integrations.lightning import StalwartCallback  # noqa: E402
from stalwart.observability.train_log import LogConfig  # noqa: E402

STEPS = 4


def test_offered_metrics_docstring() -> None:
    assert doctest.testmod(offered_metrics).failed == 0


def _records(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == "train"]


class Logs(transformers.TrainerCallback):
    """What HF's TensorBoardCallback and WandbCallback receive: on_log's ``logs``."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_hf_no_warning_the_steps_rate_and_the_callbacks_logs(tmp_path: Path) -> None:
    seen = Logs()
    callback = HfCallback(log=LogConfig(log_interval=2), run_dir=str(tmp_path / "run"))
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_steps=2,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = StalwartTrainer(
        model=_model(), args=args, train_dataset=Tokens(), callbacks=[callback, seen]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    torch_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    assert not torch_warnings, torch_warnings  # "Detected call of `lr_scheduler.step()` ..."
    records = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 4]
    # Linear decay from 1e-2 over 4 steps: step i (1-based) runs at 1e-2 * (5 - i) / 4.
    assert [r["lr"] for r in records] == pytest.approx([1e-2, 7.5e-3, 2.5e-3])
    train_logs = [x for x in seen.logs if "loss" in x]
    assert [x["learning_rate"] for x in train_logs] == pytest.approx([7.5e-3, 2.5e-3])
    for logs, record in zip(train_logs, records[1:], strict=True):  # iterations 2 and 4
        assert logs["stalwart/loss"] == pytest.approx(record["loss"])
        assert logs["stalwart/grad_norm"] == pytest.approx(record["grad_norm"])
        assert logs["stalwart/lr"] == logs["learning_rate"]
        assert logs["stalwart/skipped_iterations"] == 0 and logs["stalwart/nan_iterations"] == 0
    assert all("stalwart/loss" not in x for x in seen.logs if "train_runtime" in x)  # once each


def test_lightning_bar_loss_the_steps_rate_and_its_loggers(tmp_path: Path) -> None:
    class Scheduled(TinyLlama):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            halving = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": halving, "interval": "step"},
            }

    callback = StalwartCallback(log=LogConfig(log_interval=2), run_dir=str(tmp_path / "run"))
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_checkpointing=False,
        logger=L.loggers.CSVLogger(tmp_path, name="csv"),
        enable_progress_bar=True,
        enable_model_summary=False,
    )
    trainer.fit(Scheduled(), _loader())
    records = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 4]
    assert [r["lr"] for r in records] == pytest.approx([1e-2, 5e-3, 1.25e-3])  # as stepped
    # The bar shows the last logged interval's loss; the user logged nothing themselves.
    assert float(trainer.progress_bar_metrics["loss"]) == pytest.approx(records[-1]["loss"])
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("stalwart/loss")]
    assert [int(r["step"]) for r in rows] == [1, 2, 4]  # Lightning's global_step
    for row, record in zip(rows, records, strict=True):
        assert float(row["stalwart/loss"]) == pytest.approx(record["loss"])
        assert float(row["stalwart/lr"]) == pytest.approx(record["lr"])
        assert float(row["stalwart/grad_norm"]) == pytest.approx(record["grad_norm"])
        assert float(row["stalwart/skipped_iterations"]) == 0
