"""Bad input exits with code 2 and one line naming the flag; nothing is overwritten."""

from __future__ import annotations

import pytest

from stalwart.cli.main import main

from train_utils import TINY_FLAGS, run_cli


def _train(*args: str) -> list[str]:
    return ["train", *TINY_FLAGS, "--train-iters", "2", *args]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--lr", "abc"], "--lr"),
        (["--lr-decay-style", "step"], "--lr-decay-style"),
        (["--global-batch-size", "6"], "--global-batch-size"),
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--rerun-mode", "sometimes"], "--rerun-mode"),
        (["--ft-timeouts", "step=abc"], "--ft-timeouts"),
        (["--exit-signal", "SIGNOPE"], "--exit-signal"),
        (["--num-attention-heads", "3"], "--num-attention-heads"),
        (["--preset", "huge"], "--preset"),
        (["--num-workers", "-1"], "--num-workers"),
        (["--data-path", "0.3", "a.bin", "0.7"], "--data-path"),
        (["--manual-gc", "--manual-gc-interval", "-3"], "--manual-gc-interval"),
        (
            ["--check-weight-hash-across-dp-replicas-interval", "-1"],
            "--check-weight-hash-across-dp-replicas-interval",
        ),
        (
            ["--check-weight-hash-across-dp-replicas-interval", "2", "--use-torch-fsdp2"],
            "--use-torch-fsdp2",
        ),
        (["--inject-fault", "bitflip"], "--inject-fault-iteration"),
        # Hang detection, graceful exit and fault injection (issue 4).
        (["--ft-timeouts", "stepp=3"], "--ft-timeouts: bad entry"),
        (["--ft-timeouts", "step=-1"], "--ft-timeouts: step must be"),
        (["--ft-timeouts", "step=2,step=3"], "--ft-timeouts: step given twice"),
        (["--ft-timeouts", "step=inf"], "--ft-timeouts"),
        (["--exit-signal", "SIGKILL"], "--exit-signal"),
        (["--enable-ft", "--exit-signal", "SIGUSR2"], "--exit-signal: SIGUSR2 is used"),
        (["--enable-ft", "--calc-ft-timeouts"], "--calc-ft-timeouts: requires --save"),
        (["--inject-fault", "explode"], "--inject-fault"),
        (["--inject-fault", "hang"], "--inject-fault-iteration"),
        (["--inject-fault", "hang", "--inject-fault-iteration", "2"], "needs --save"),
        (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins"),
        (["--exit-interval", "-3"], "--exit-interval"),
        (["--phase-transition-iterations", "0"], "--phase-transition-iterations"),
        (["--non-persistent-save-interval", "2"], "--non-persistent-save-interval needs --save"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, args: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as info:
        code = main(_train(*args))
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_missing_data_file_exits_2(tmp_path) -> None:
    proc = run_cli(_train("--data-path", str(tmp_path / "nope.txt")))
    assert proc.returncode == 2
    assert "--data-path" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_save_dir_fails_before_training(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli(_train("--save", str(blocker / "ckpt")))
    assert proc.returncode == 2, proc.stderr
    assert "--save" in proc.stderr and "Traceback" not in proc.stderr
    assert "iteration" not in proc.stdout  # no training happened
    assert blocker.read_text() == "not a directory"


def test_unreadable_checkpoint_is_a_clear_error_and_nothing_overwritten(tmp_path) -> None:
    save = tmp_path / "ckpt"
    assert run_cli(_train("--save", str(save))).returncode == 0
    (save / "iter_0000002" / ".metadata").write_bytes(b"garbage")
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    proc = run_cli(_train("--save", str(save), "--train-iters", "4"))
    assert proc.returncode == 2
    assert "iter_0000002" in proc.stderr and "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    assert before == after


def test_print_config_and_toml(tmp_path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[optimizer]\nweight-decay = 0.05\ntrain_iters = 7\n")
    assert main(_train("--config", str(toml), "--print-config")) == 0
    out = capsys.readouterr().out
    assert '"weight_decay": 0.05' in out and '"train_iters": 2' in out  # CLI wins over the file


def test_unknown_toml_key_exits_2(tmp_path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("nonsense = 1\n")
    with pytest.raises(SystemExit) as info:
        main(_train("--config", str(toml)))
    assert info.value.code == 2
