"""Hang sections through each adapter: a step that never returns is detected by the per-rank
monitor, which kills the process and writes the report naming the ``step`` section."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

COMMON = """
import sys, time, torch
from stalwart.reliability.hang.sections import FaultToleranceConfig, SectionTimeouts
save = sys.argv[1]
ft = FaultToleranceConfig(enable_ft=True, ft_num_warmup_iters=0, poll_interval_s=0.1,
                          timeouts=SectionTimeouts(setup=120, step=2, out_of_section=120))
ids = torch.randint(0, 32, (32, 4))

def stuck_in_the_step():
    time.sleep(120)
"""

SCRIPTS = {
    "hf": """
import transformers
from stalwart.integrations.hf import StalwartCallback

class Hang(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            stuck_in_the_step()

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
    def forward(self, input_ids, labels):
        return {"loss": self.emb(input_ids).square().mean()}

data = [{"input_ids": row, "labels": row} for row in ids]
args = transformers.TrainingArguments(save, max_steps=5, per_device_train_batch_size=4,
    save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
transformers.Trainer(model=Model(), args=args, train_dataset=data,
                     callbacks=[StalwartCallback(ft=ft), Hang()]).train()
""",
    "lightning": """
import lightning.pytorch as L
from stalwart.integrations.lightning import GuardedModule, StalwartCallback

class Module(GuardedModule, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
    def forward_step(self, batch):
        if self.trainer.global_step == 2:
            stuck_in_the_step()
        return self.emb(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(max_steps=5, accelerator="cpu", callbacks=[StalwartCallback(save, ft=ft)],
                    enable_checkpointing=False, logger=False, enable_progress_bar=False)
trainer.fit(Module(), torch.utils.data.DataLoader(ids, batch_size=4))
""",
}


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_hung_step_is_detected_and_killed(framework: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers" if framework == "hf" else "lightning.pytorch")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(COMMON) + textwrap.dedent(SCRIPTS[framework]))
    save = tmp_path / "save"
    proc = subprocess.run(
        [sys.executable, str(script), str(save)], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((save / "ft_logs" / "ft_hang_rank0.json").read_text())
    assert report["section"] == "step" and report["timeout_s"] == 2
    assert "stuck_in_the_step" in (save / "ft_logs" / "monitor_rank0.log").read_text()
