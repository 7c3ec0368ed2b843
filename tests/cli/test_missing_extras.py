"""A flag whose optional package is missing (or does not import): one line naming the flag and
the ``pip install 'stalwart[...]'`` to run, exit 2, before start-up (nothing built or written)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.loop import ShellConfig
from stalwart.observability.sinks import SinkConfig

from train_utils import TINY_FLAGS

EXTRAS = [  # (flags, the module made unimportable, the extra)
    (["--tensorboard-dir", "{d}/tb"], "torch.utils.tensorboard", "tensorboard"),
    (["--wandb-project", "p", "--wandb-save-dir", "{d}/wb"], "wandb", "wandb"),
    (["--log-energy"], "pynvml", "nvml"),
]


@pytest.mark.parametrize(("flags", "module", "extra"), EXTRAS, ids=[e[2] for e in EXTRAS])
def test_a_missing_extra_is_one_line_and_exit_2_before_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, flags, module, extra
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails
    save = tmp_path / "save"
    argv = [f.format(d=tmp_path) for f in flags]
    assert main(["train", *TINY_FLAGS, "--train-iters", "1", "--save", str(save), *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"stalwart train: error: {argv[0]} needs ")
    assert f"pip install 'stalwart[{extra}]'" in lines[0]
    assert not save.exists() and not (tmp_path / "tb").exists()  # before start-up


def test_the_shell_refuses_a_missing_extra_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    config = ShellConfig(
        train_iters=2, save_dir=str(tmp_path / "s"), sinks=SinkConfig(wandb_project="p")
    )
    with pytest.raises(
        ValueError, match=r"^ShellConfig\.sinks\.wandb_project needs .*stalwart\[wandb\]"
    ):
        config.build()
    assert not (tmp_path / "s").exists()


class _UsageError(Exception):
    """wandb.errors.UsageError's stand-in."""


def _wandb_without_login(calls: list[dict]) -> types.ModuleType:
    """A ``wandb`` whose ``init`` raises as wandb's does without a login (no API key, no
    netrc, no terminal to ask; no network here either)."""

    def init(**kwargs: object) -> None:
        calls.append(dict(kwargs))
        raise _UsageError("No API key configured. Use `wandb login` to log in.")

    module = types.ModuleType("wandb")
    module.init = init  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("save", [False, True])
def test_wandb_without_a_login_is_one_line_exit_2_and_leaves_no_artefacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], save: bool
) -> None:
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "wandb", _wandb_without_login(calls))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "STALWART_RUNS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # the default run directory is runs/<time> here
    where = ["--save", "ckpt", "--tensorboard-dir", "tb"] if save else []
    argv = ["train", *TINY_FLAGS, "--train-iters", "2", "--wandb-project", "p", *where]
    assert main(argv) == 2
    assert len(calls) == 1  # it got as far as the W&B start
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (
        "stalwart train: error: --wandb-project p: W&B did not start a run (_UsageError: No API "
        "key configured. Use `wandb login` to log in.): log in with `wandb login` or set "
        "WANDB_API_KEY, or pass --wandb-mode offline (sync later with `wandb sync`)"
    )
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    # Nothing of this start: no runs/<time>/goodput.jsonl, no TensorBoard file, no W&B
    # directory; only the --save directory itself, probed (empty) before anything ran.
    assert left == (["ckpt"] if save else []), left
