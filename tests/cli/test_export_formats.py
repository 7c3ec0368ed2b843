"""``stalwart export``: safetensors for ``--out *.safetensors`` (not a pickle), and a Hugging Face
``LlamaForCausalLM`` directory (``--format hf``) that transformers loads to the same logits."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.cli.main import main
from stalwart.distributed.process_group import DistributedContext
from stalwart.models import GPT, GPTConfig
from stalwart.train.trainer import run_training

from train_utils import assert_params_equal, load_params, make_config

LLAMA = [
    "--preset", "llama-tiny", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "96",
    "--vocab-size", "512", "--seq-length", "32",
]  # fmt: skip


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, flags in (("gpt", []), ("llama", LLAMA)):
        save = root / name
        run_training(make_config(*flags, "--train-iters", "3", "--save", str(save)),
                     DistributedContext())  # fmt: skip
        out[name] = save
    return out


def test_safetensors_suffix_writes_safetensors(saves: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "w.safetensors"
    assert main(["export", "--load", str(saves["gpt"]), "--out", str(out)]) == 0
    assert not out.read_bytes().startswith(b"PK")  # torch.save writes a zip of pickles
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open has no iter
    config = json.loads(meta["model_config"])
    assert meta["iteration"] == "3" and meta["source"].endswith("iter_0000003")
    model = GPT(GPTConfig(**config))
    model.load_state_dict(state)
    assert_params_equal(model.state_dict(), load_params(saves["gpt"]))


def test_hf_layout_gives_the_same_logits_in_transformers(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "--load", str(saves["llama"]), "--format", "hf", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    payload = tmp_path / "w.pt"
    assert main(["export", "--load", str(saves["llama"]), "--out", str(payload)]) == 0
    saved = torch.load(payload, weights_only=True)
    ours = GPT(GPTConfig(**saved["model_config"])).eval()
    ours.load_state_dict(saved["model"])
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)
        got = hf(input_ids=ids).logits
    assert got.shape == expected.shape == (2, 17, 512)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("fmt", "needle"),
    [("hf", "--format hf: checkpoint"), ("safetensors", "need the 'safetensors' package")],
)
def test_refusals_are_one_line(
    saves: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    needle: str,
) -> None:
    if fmt == "safetensors":  # the package missing: the optional extra's refusal
        real_import = builtins.__import__

        def no_safetensors(name: str, *args: Any, **kwargs: Any) -> Any:
            if name.startswith("safetensors"):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_safetensors)
    out = tmp_path / ("hf" if fmt == "hf" else "w.safetensors")
    # GPT-2 (learned positions, LayerNorm, GELU, biases) has no Llama layout.
    assert main(["export", "--load", str(saves["gpt"]), "--format", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists() or not any(out.iterdir())


def test_hf_export_docstring_examples() -> None:
    import doctest

    from stalwart.models import hf_export

    assert doctest.testmod(hf_export).failed == 0
