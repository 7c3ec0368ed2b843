"""``stalwart export``: safetensors for ``--out *.safetensors`` (not a pickle), and a Hugging Face
``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory (``--format hf``) that transformers loads to
the same logits."""

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
# GPT-2 with an untied output layer, no biases and its own MLP width: still GPT2LMHeadModel.
GPT2_VARIANT = ["--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--ffn-hidden-size", "96", "--norm-epsilon", "1e-6"]  # fmt: skip
# RoPE with LayerNorm and GELU: neither GPT-2 nor Llama.
MIXED = ["--position-embedding-type", "rope"]


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    out = {}
    runs = (("gpt", []), ("llama", LLAMA), ("gpt2_variant", GPT2_VARIANT), ("mixed", MIXED))
    for name, flags in runs:
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


def _logits_ours_and_hf(save: Path, tmp_path: Path, hf_class: str) -> tuple[Any, Any]:
    """Export ``save`` twice (torch payload, HF directory); the logits of both on one batch."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "--load", str(save), "--format", "hf", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [hf_class]
    hf = getattr(transformers, hf_class).from_pretrained(str(out)).eval()
    payload = tmp_path / "w.pt"
    assert main(["export", "--load", str(save), "--out", str(payload)]) == 0
    saved = torch.load(payload, weights_only=True)
    ours = GPT(GPTConfig(**saved["model_config"])).eval()
    ours.load_state_dict(saved["model"])
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ours(ids), hf(input_ids=ids).logits


def test_hf_layout_gives_the_same_logits_in_transformers(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    expected, got = _logits_ours_and_hf(saves["llama"], tmp_path, "LlamaForCausalLM")
    assert got.shape == expected.shape == (2, 17, 512)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt", "gpt2_variant"])
def test_gpt2_exports_as_gpt2lmheadmodel_with_the_same_logits(
    saves: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """The default preset (tied embeddings, learned positions, exact GELU, biases) and a
    variant (untied, no biases, its own MLP width and epsilon): float32 logits within 1e-4."""
    expected, got = _logits_ours_and_hf(saves[name], tmp_path, "GPT2LMHeadModel")
    assert got.shape == expected.shape == (2, 17, 512)
    assert expected.abs().max() > 0.1  # a trained model, not all zeros
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
    # RoPE with LayerNorm and GELU is neither GPT-2 nor Llama: the line names both.
    assert main(["export", "--load", str(saves["mixed"]), "--format", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    if fmt == "hf":
        assert "not GPT-2 (RoPE" in err and "not Llama (LayerNorm" in err, err
    assert not out.exists() or not any(out.iterdir())


def test_hf_export_docstring_examples() -> None:
    import doctest

    from stalwart.models import hf_export

    assert doctest.testmod(hf_export).failed == 0
