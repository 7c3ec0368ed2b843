"""The README's "With Lightning" and "With the Hugging Face Trainer" blocks run as written, on a
tiny Hugging Face ``LlamaForCausalLM``; and ``import stalwart`` needs neither framework."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
VOCAB, SEQ, N = 64, 8, 3


def _block(heading: str) -> str:
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return block


def _namespace(save_dir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    return {
        "my_model": transformers.LlamaForCausalLM(config),
        "my_loader": torch.utils.data.DataLoader(dataset, batch_size=4),
        "my_dataset": dataset,
        "save_dir": str(save_dir),
        "n": N,
    }


@pytest.mark.parametrize("heading", ["With Lightning", "With the Hugging Face Trainer"])
def test_readme_block_trains_saves_and_records_the_exit(
    heading: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if heading == "With Lightning":
        pytest.importorskip("lightning.pytorch")
    monkeypatch.chdir(tmp_path)
    save = tmp_path / "run"
    namespace = _namespace(save)
    exec(compile(_block(heading), str(README), "exec"), namespace)
    assert namespace["callback"].exit_code == 0
    reason = json.loads((save / "exit_reason.json").read_text())
    assert reason["exit_code"] == 0 and reason["iteration"] == N
    saved = {p.name for p in save.iterdir()}
    assert f"iter_{N:07d}.ckpt" in saved or f"checkpoint-{N}" in saved, saved
    assert (save / "metrics.jsonl").is_file() and (save / "goodput.jsonl").is_file()


def test_import_stalwart_needs_neither_framework() -> None:
    """Blocked imports: ``import stalwart`` and the shared integration pieces work; an adapter
    says which extra to install, in one line."""
    code = (
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate'):\n"
        "    sys.modules[name] = None\n"
        "import stalwart, stalwart.loop.shell, stalwart.integrations.framework_step\n"
        "import stalwart.observability.flop_count, stalwart.train, stalwart.cli.main\n"
        "for module in ('lightning', 'hf'):\n"
        "    try:\n"
        "        __import__('stalwart.integrations.' + module)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert "pip install 'stalwart[lightning]'" in lines[0]
    assert "pip install 'stalwart[hf]'" in lines[1]
