"""A user's error inside a framework's step is the last thing a user reads: the Hugging Face
Trainer with a model that raises or a ``gradient_accumulation_steps`` the guarded step cannot
drive, Lightning with a module that raises. Nothing of stalwart's prints after the traceback (no
"Exception ignored in ...", no shutdown-time ``ImportError`` from a context left open)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import torch

case, out = sys.argv[1], sys.argv[2]
if case.startswith("hf"):
    import transformers
    import test_hf_trainer as t
    from stalwart.integrations.hf import StalwartCallback, StalwartTrainer

    class Raising(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = t._model()

        def forward(self, input_ids=None, labels=None):
            raise RuntimeError("the user's model failed")

    accumulation = 2 if case == "hf-accumulation" else 1
    args = transformers.TrainingArguments(
        out, max_steps=3, per_device_train_batch_size=4, save_strategy="no", report_to=[],
        use_cpu=True, logging_strategy="no", disable_tqdm=True,
        gradient_accumulation_steps=accumulation,
    )
    model = Raising() if case == "hf-model" else t._model()
    StalwartTrainer(model=model, args=args, train_dataset=t.Tokens(),
                    callbacks=[StalwartCallback()]).train()
else:
    import lightning.pytorch as L
    import test_lightning as t

    class Raising(t.TinyLlama):
        def forward_step(self, batch):
            raise RuntimeError("the user's model failed")

    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=1, callbacks=[t.StalwartCallback(out)],
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Raising(), t._loader())
"""

CASES = {
    "hf-model": "RuntimeError: the user's model failed",
    "hf-accumulation": "ValueError: TrainingArguments(gradient_accumulation_steps=...) must be 1",
    "lightning-model": "RuntimeError: the user's model failed",
}


@pytest.mark.parametrize("case", CASES)
def test_the_users_error_is_the_last_thing_printed(case: str, tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(here=str(HERE)))
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"))
    proc = subprocess.run(
        [sys.executable, str(script), case, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    tail = proc.stderr.rstrip().splitlines()
    assert tail[-1].startswith(CASES[case]), proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr and "sys.meta_path" not in proc.stderr
