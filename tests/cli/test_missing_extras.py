"""A flag whose optional package is missing (or does not import): one line naming the flag and
the ``pip install 'stalwart[...]'`` to run, exit 2, before start-up (nothing built or written)."""

from __future__ import annotations

import sys
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
