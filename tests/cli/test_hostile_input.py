"""A hostile-input audit of ``stalwart train``: every bad flag, TOML file, path or environment
variable is exit code 2 and one line naming it, before anything is built or written.

All in-process (``main(argv)``): each case fails in parsing or validation, so no model is built.
The first group are the cases the audit found wrong (a traceback mid-run or a silently different
run); the rest pin the recently added flags' refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.config.paths import check_output_dir, check_output_file

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "16", "--vocab-size", "512", "--micro-batch-size", "2",
    "--train-iters", "1", "--use-cpu",
]  # fmt: skip


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A file where a directory belongs, a directory where a file belongs, and bad TOML files."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "binary.toml").write_bytes(b"x\x00\xff\xfe")
    (tmp_path / "truncated.toml").write_text('[training]\nlr = "abc')
    (tmp_path / "wrong_type.toml").write_text("[training]\nmicro_batch_size = 2.5\n")
    (tmp_path / "nan.toml").write_text("[optimizer]\nlr = nan\n")
    (tmp_path / "switch.toml").write_text('[training]\nbf16 = "yes"\n')
    (tmp_path / "gc.toml").write_text("[training]\nmanual_gc_interval = 5\n")
    return tmp_path


def _exit_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(["train", *TINY, *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# Found by the audit: each ran into a traceback mid-run, or ran with the value silently ignored.
FOUND = [
    # A traceback from the sink that opened the path (after the model was built).
    (["--tensorboard-dir", "{d}/a_file"], "--tensorboard-dir '{d}/a_file' is a file"),
    (["--tensorboard-dir", "{d}/a_file/sub"], "'{d}/a_file' is a file, not a directory"),
    (["--dump-dir", "{d}/a_file", "--save-params-interval", "1"], "--dump-dir"),
    (["--profile", "--profile-dir", "{d}/a_file"], "--profile-dir"),
    (["--metrics-file", "{d}/a_dir"], "--metrics-file '{d}/a_dir' is a directory"),
    (["--metrics-file", "{d}/a_file/m.jsonl"], "--metrics-file"),
    (["--wandb-save-dir", "{d}/a_file"], "--wandb-save-dir"),
    (["--tensorboard-dir", ""], "--tensorboard-dir is empty"),
    (["--save", ""], "--save is empty"),
    (["--run-dir", ""], "--run-dir is empty"),  # wrote goodput.jsonl into the working directory
    (["--eval-interval", "1", "--eval-iters", "0"], "--eval-iters >= 1"),  # empty evaluations
    # Accepted and ignored: a different run than the one asked for.
    (["--manual-gc-interval", "5"], "need --manual-gc"),
    (["--no-manual-gc-eval"], "need --manual-gc"),
    (["--config", "{d}/gc.toml"], "need --manual-gc"),
    (["--bf16", "--bf16-compute-weights", "--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (["--lr-warmup-iters", "5", "--lr-decay-iters", "3"], "--lr-warmup-iters (5) must be <="),
]

# Already refused; pinned so that they stay refused.
PINNED = [
    (["--compile", "--inductor-config", "nosuch=1"], "not an Inductor option"),
    (["--compile", "--inductor-config", "max_autotune=3"], "max_autotune"),
    (["--compile", "--inductor-config", ""], "takes KEY=VALUE"),
    (["--compile", "--inductor-config", "max_autotune"], "takes KEY=VALUE"),
    (
        [
            "--compile",
            "--inductor-config",
            "max_autotune=True",
            "--inductor-config",
            "max_autotune=False",
        ],
        "given twice",
    ),
    (["--compile", "--inductor-config", "max_autotune=__import__('os')"], "Python literal"),
    (["--inductor-config", "max_autotune=True"], "needs --compile"),
    (["--clip-grad-in-optimizer", "--clip-grad", "0"], "--clip-grad > 0"),
    (["--clip-grad-in-optimizer", "--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (["--bf16-compute-weights"], "needs --bf16"),
    (["--bf16-residual-connection", "--fp16"], "needs --bf16"),
    (["--recompute-num-layers", "-1"], "--recompute-num-layers"),
    (["--recompute-granularity", "full"], "--recompute-method"),
    (
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "5",
        ],
        "[1, --num-layers=1]",
    ),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "full"),
    (["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base"),
    (["--position-embedding-type", "rope", "--rotary-base", "nan"], "--rotary-base"),
    (["--rotary-base", "500"], "--position-embedding-type rope"),
    (["--group-query-attention", "--num-query-groups", "3"], "must divide"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups"),
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--micro-batch-size", "3", "--global-batch-size", "4"], "--global-batch-size"),
    (["--seq-length", "0"], "--seq-length"),
    *[(["--lr", v], "--lr") for v in ("nan", "inf", "1e400", "-0", "", "-1")],
    *[(["--train-iters", v], "--train-iters") for v in ("0", "-1", "99999999999999999999")],
    (["--log-interval", "0"], "--log-interval"),
    (["--config", "{d}/binary.toml"], "binary.toml"),
    (["--config", "{d}/truncated.toml"], "truncated.toml"),
    (["--config", "{d}/wrong_type.toml"], "--micro-batch-size"),
    (["--config", "{d}/nan.toml"], "--lr"),
    (["--config", "{d}/switch.toml"], "--bf16 is a switch"),
    (["--config", "{d}/a_dir"], "not a regular file"),
    (["--save", "{d}/a_file"], "--save"),
]


@pytest.mark.parametrize(("argv", "needle"), FOUND + PINNED)
def test_bad_input_is_exit_2_and_one_line(
    capsys: pytest.CaptureFixture[str], files: Path, argv: list[str], needle: str
) -> None:
    err = _exit_line(capsys, [a.format(d=files) for a in argv])
    assert needle.format(d=files) in err, err


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "5"}, "RANK='5'"),  # found: ran quietly as rank 5 of a world of one
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
        ({"LOCAL_RANK": "nan"}, "LOCAL_RANK"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT"),
        ({"STALWART_INPROCESS_PORT": "abc"}, "STALWART_INPROCESS_PORT"),
    ],
)
def test_bad_environment_is_exit_2_and_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    needle: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert needle in _exit_line(capsys, [])


def test_output_path_checks_accept_what_can_be_written(tmp_path: Path) -> None:
    check_output_dir("--tensorboard-dir", str(tmp_path))  # exists
    check_output_dir("--tensorboard-dir", str(tmp_path / "new" / "deeper"))  # can be created
    check_output_file("--metrics-file", str(tmp_path / "new" / "m.jsonl"))
    (tmp_path / "m.jsonl").write_text("")
    check_output_file("--metrics-file", str(tmp_path / "m.jsonl"))  # appended to
    check_output_dir("--dump-dir", None)  # unset


def test_report_output_that_is_a_directory_is_one_line_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str], files: Path
) -> None:
    from stalwart.cli.report import main_report

    (files / "run").mkdir()
    assert main_report([str(files / "run"), "-o", str(files / "a_dir"), "--no-png"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--output" in err and len(err.splitlines()) == 1, err
    assert not (files / "a_dir.tmp").exists()  # found: a 5 MB temporary file was left


def test_paths_docstring_example_runs() -> None:
    import doctest

    import stalwart.config.paths

    assert doctest.testmod(stalwart.config.paths).failed == 0
