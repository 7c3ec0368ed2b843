"""``--print-config`` writes what ``--config`` reads: the same bytes back, and the same run.

``stalwart train FLAGS --print-config > run.toml; stalwart train --config run.toml
--print-config`` must print the same text, and both must build the same ``RunConfig``. Switches
are spelled one way (positive name = the value the setting ends as), with the negated flag's
spelling accepted as an alias.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from stalwart.cli.args import build_train_parser, parse_train_args
from stalwart.cli.main import main
from stalwart.config.run import build_run_config

from train_utils import TINY_FLAGS

LLAMA = ["--preset", "llama-tiny", "--swiglu", "--group-query-attention", "--num-query-groups",
         "2", "--position-embedding-type", "rope", "--rotary-base", "5000", "--normalization",
         "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--norm-epsilon", "1e-6"]  # fmt: skip
CASES = {
    "defaults": [],
    "tiny test flags": TINY_FLAGS,
    "lists": [
        "--data-path",
        "0.3",
        "a.bin",
        "0.7",
        "b.txt",
        "--profile-ranks",
        "0",
        "1",
        "--iterations-to-skip",
        "3",
        "9",
        "--rampup-batch-size",
        "4",
        "4",
        "1000",
        "--global-batch-size",
        "16",
        "--error-injection-iterations",
        "2",
        "--error-injection-rate",
        "1",
        "--phase-transition-iterations",
    ],
    "switches and negated switches": [
        "--bf16",
        "--no-shuffle",
        "--no-load-optim",
        "--no-progress-bar",
        "--no-cuda-graph-speculative-launch",
        "--no-exit-on-interrupt",
        "--no-manual-gc-eval",
        "--no-check-for-nan-in-loss-and-grad",
        "--manual-gc",
        "--no-log-loss-scale-to-tensorboard",
    ],
    "exit on interrupt": ["--exit-on-interrupt", "--exit-duration-in-mins", "90.5"],
    "unset and sample-based": [
        "--train-samples",
        "640",
        "--lr-warmup-samples",
        "64",
        "--lr-decay-samples",
        "600",
    ],
    "preset gpt2 with overrides": [
        "--preset",
        "gpt2-124m",
        "--num-layers",
        "2",
        "--lr",
        "6e-4",
        "--min-lr",
        "6e-5",
        "--lr-decay-style",
        "linear",
    ],
    "llama switches": LLAMA,
    "llama preset, recompute": [
        "--preset",
        "llama-tiny",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],
    "demo": ["--demo"],
    "megatron spellings": [
        "--enable-ft-package",
        "--moe-capacity-factor",
        "1.5",
        "--num-experts",
        "2",
        "--straggler-minmax-count",
        "2",
        "--save-dgrads-interval",
        "5",
        "--log-progress",
        "--save",
        "ckpt",
        "--tensor-model-parallel-size",
        "1",
    ],
    "odd strings": [
        "--save",
        'runs/a "b" \\ c\té',
        "--exit-signal",
        "SIGUSR1",
        "--ft-timeouts",
        "step=30,setup=60",
        "--wandb-exp-name",
        "#not a comment",
    ],
    "scheduler flags": ["--override-opt-param-scheduler", "--lr-decay-iters", "50"],
    "observability modes (enums)": [
        "--timing-mode",
        "events",
        "--timing-log-option",
        "all",
        "--wandb-mode",
        "offline",
    ],
}


def _print(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["train", *argv, "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _run_config(argv: list[str]) -> dict[str, object]:
    return build_run_config(parse_train_args(argv), argv).to_dict()


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_printed_config_reads_back_to_the_same_bytes_and_run(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    printed = _print(argv, capsys)
    path = tmp_path / "run.toml"
    path.write_text(printed, encoding="utf-8")
    assert _print(["--config", str(path)], capsys) == printed
    assert _run_config(["--config", str(path)]) == _run_config(argv)
    # The file is plain TOML and every key is a flag's.
    flat: dict[str, object] = {}

    def walk(table: dict[str, object]) -> None:
        for key, value in table.items():
            walk(value) if isinstance(value, dict) else flat.setdefault(key, value)  # type: ignore[arg-type]

    walk(tomllib.loads(printed))
    assert "print_config" not in flat and "config" not in flat
    assert len(flat) > 100


def test_every_flag_is_in_the_printed_config(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _print([], capsys)
    for action in build_train_parser()._actions:
        if action.dest in ("help", "config", "print_config") or not action.option_strings:
            continue
        if action.help == "==SUPPRESS==":  # refused Megatron flags
            continue
        if action.dest == "==SUPPRESS==":  # Megatron switches that hold anyway: store nothing
            continue
        key = (
            action.dest.removeprefix("no_")
            if action.option_strings[0].startswith("--no-") and action.dest.startswith("no_")
            else action.dest
        )
        assert f"\n{key} = " in printed or f"\n# {key}: unset" in printed, key


def test_switches_are_written_by_their_positive_name(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _print(["--no-shuffle", "--no-load-optim", "--bf16"], capsys)
    for line in ("shuffle = false", "load_optim = false", "load_rng = true", "bf16 = true",
                 "cuda_graph_speculative_launch = true", "# exit_on_interrupt: unset",
                 "# swiglu: unset"):  # fmt: skip
        assert f"\n{line}\n" in printed, line
    assert "no_shuffle" not in printed and "no_load_optim" not in printed


@pytest.mark.parametrize(
    ("text", "flags"),
    [
        ("shuffle = false", ["--no-shuffle"]),
        ("no_shuffle = true", ["--no-shuffle"]),
        ("no-shuffle = true", ["--no-shuffle"]),
        ("shuffle = true", []),
        ("load_optim = false", ["--no-load-optim"]),
        ("no_load_optim = true", ["--no-load-optim"]),
        ("load-optim = true", []),
        ("cuda_graph_speculative_launch = false", ["--no-cuda-graph-speculative-launch"]),
        ("no_cuda_graph_speculative_launch = true", ["--no-cuda-graph-speculative-launch"]),
        ("exit_on_interrupt = false", ["--no-exit-on-interrupt"]),
        ("progress_bar = false", ["--no-progress-bar"]),
        ("bf16 = true", ["--bf16"]),
        ("enable_ft_package = true", ["--enable-ft"]),
    ],
)
def test_one_spelling_of_switches_means_the_flag(
    tmp_path: Path, text: str, flags: list[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    assert _run_config(["--config", str(path)]) == _run_config(flags)


def test_false_turns_a_preset_switch_off(tmp_path: Path) -> None:
    """``swiglu = false`` under a llama preset means GELU (the value the setting ends as),
    not "the flag is not given" (which would silently keep the preset's SwiGLU)."""
    path = tmp_path / "run.toml"
    path.write_text('preset = "llama-tiny"\nswiglu = false\ndisable_bias_linear = false\n')
    model = _run_config(["--config", str(path)])["model"]
    assert model["swiglu"] is False and model["add_bias_linear"] is True  # type: ignore[index]
    llama = _run_config(["--preset", "llama-tiny"])["model"]
    assert llama["swiglu"] is True and llama["add_bias_linear"] is False  # type: ignore[index]


@pytest.mark.parametrize(
    "text", ["no_shuffle = true\nshuffle = false", "load_optim = true\nno-load-optim = false"]
)
def test_both_spellings_of_one_switch_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sets the same flag" in err, err


def test_command_line_wins_over_the_printed_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(_print(["--lr", "1e-3", "--no-shuffle"], capsys))
    again = _print(["--config", str(path), "--lr", "2e-3"], capsys)
    assert "\nlr = 0.002\n" in again and "\nshuffle = false\n" in again


def test_a_value_toml_cannot_hold_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--save", "bad\udcffname", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--save" in err and "UTF-8" in err, err
