"""Bad input exits with code 2 and one line naming the flag; nothing is overwritten.

A job that must run as its own process (its exit code, its output, what it left on disk) is
forked from the test's fork server (``run_cli_on_ranks``), as fresh as ``python -m stalwart``
without ~4 s of CPU importing torch each time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.cli.main import main

from dist_utils import RankExits, run_cli_on_ranks
from train_utils import TINY_FLAGS


def _train(*args: str) -> list[str]:
    return ["train", *TINY_FLAGS, "--train-iters", "2", *args]


def _job(log_dir: Path, *args: str) -> RankExits:
    """``stalwart train`` (``_train(*args)``) as one fresh process forked from the fork server."""
    return run_cli_on_ranks(_train(*args), log_dir, world_size=1)


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
    proc = _job(tmp_path / "logs1", "--data-path", str(tmp_path / "nope.txt"))
    assert proc.returncode == 2
    assert "--data-path" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_save_dir_fails_before_training(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = _job(tmp_path / "logs2", "--save", str(blocker / "ckpt"))
    assert proc.returncode == 2, proc.stderr
    assert "--save" in proc.stderr and "Traceback" not in proc.stderr
    assert "iteration" not in proc.stdout  # no training happened
    assert blocker.read_text() == "not a directory"


def test_unreadable_checkpoint_is_a_clear_error_and_nothing_overwritten(tmp_path) -> None:
    save = tmp_path / "ckpt"
    assert _job(tmp_path / "logs3", "--save", str(save)).returncode == 0
    (save / "iter_0000002" / ".metadata").write_bytes(b"garbage")
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    proc = _job(tmp_path / "logs4", "--save", str(save), "--train-iters", "4")
    assert proc.returncode == 2
    assert "iter_0000002" in proc.stderr and "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    assert before == after  # the goodput ledger included: a refused launch writes no session


def test_print_config_and_toml(tmp_path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[optimizer]\nweight-decay = 0.05\ntrain_iters = 7\n")
    assert main(_train("--config", str(toml), "--print-config")) == 0
    out = capsys.readouterr().out
    assert "\nweight_decay = 0.05\n" in out and "\ntrain_iters = 2\n" in out  # CLI wins


def test_unknown_toml_key_exits_2(tmp_path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("nonsense = 1\n")
    assert main(_train("--config", str(toml))) == 2


# ---------------------------------------------------------------------------------------------
# Issue 13, bad input: one line, exit code 2, the real flag (or file, or variable) named, nothing
# created. Each case runs `stalwart train` in this process with --save and --metrics-file inside
# an otherwise empty directory, which must stay as it was.


def _refused(capsys, tmp_path, args: list[str], needles: list[str]) -> str:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    before = sorted(p.name for p in work.iterdir())
    argv = _train("--save", str(work / "ckpt"), "--metrics-file", str(work / "m.jsonl"), *args)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    assert sorted(p.name for p in work.iterdir()) == before, "bad input touched the run directory"
    return err


TOML_CASES = [
    ("train_iters = true", ["train_iters", "--train-iters"]),
    ("train_iters = 1.5", ["train_iters", "integer"]),
    ("micro_batch_size = 2.5", ["micro_batch_size", "integer"]),
    ("seed = 1e30", ["seed", "integer"]),
    ("seed = 4294967296", ["seed", "[0, 4294967295]"]),
    ('wandb_mode = "bogus"', ["wandb_mode", "online"]),
    ('exit_signal_handler = "no"', ["exit_signal_handler", "true or false"]),
    ("exit-signal-handler = 1", ["exit-signal-handler", "true or false"]),
    ("bf16 = 0", ["bf16", "true or false"]),
    ("lr = [1e-3, 2e-3]", ["lr", "one value, not a list"]),
    ("lr = inf", ["lr", "finite"]),
    ("lr = nan", ["lr", "finite"]),
    ("profile_ranks = [[0]]", ["profile_ranks", "--profile-ranks takes a string or a number"]),
    ("rampup_batch_size = [4, 4]", ["rampup_batch_size", "expected 3 arguments"]),
    ("save_interval = 1979-05-27", ["save_interval", "date"]),
    ('config = "other.toml"', ["unknown key 'config'"]),
    ("[training]\ntrain-iters = 5\n[more]\ntrain_iters = 6", ["train_iters", "same flag"]),
    ("no_shuffle = true\nshuffle = true", ["shuffle", "same flag"]),
    ("train_iters = 5\nnonsense = [", ["cannot read"]),
]


@pytest.mark.parametrize(("text", "needles"), TOML_CASES, ids=[c[0] for c in TOML_CASES])
def test_config_file_values_are_checked_like_flags(capsys, tmp_path, text, needles) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(text + "\n")
    _refused(capsys, tmp_path, ["--config", str(toml)], [str(toml), *needles])


def test_config_file_that_is_binary_is_one_line(capsys, tmp_path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_bytes(b"\xff\xfe\x00garbage\x80")
    _refused(capsys, tmp_path, ["--config", str(toml)], ["--config", str(toml)])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no-shuffle = true", {"shuffle": False}),
        ("shuffle = false", {"shuffle": False}),
        ("shuffle = true", {"shuffle": True}),
        ("exit_signal_handler = true", {"exit_signal_handler": True}),
        ("exit_signal_handler = false", {"exit_signal_handler": False}),
        ("cuda_graph_speculative_launch = false", {"cuda_graph_speculative_launch": False}),
        ("no-cuda-graph-speculative-launch = true", {"cuda_graph_speculative_launch": False}),
        ("data_path = 'a.bin'", {"data_path": ["a.bin"]}),
        ("iterations_to_skip = []", {"iterations_to_skip": []}),
        ("error_injection_ranks = 1", {"error_injection_ranks": [1]}),
        ("exit_signal = 'SIGUSR1'", {"exit_signal": "SIGUSR1"}),
        ("[optimizer]\nlr = 2e-3\nadam-beta2 = 0.99", {"lr": 2e-3, "adam_beta2": 0.99}),
    ],
)
def test_config_file_values_mean_what_the_flags_mean(tmp_path, text, expected) -> None:
    from stalwart.cli.args import parse_train_args

    toml = tmp_path / "run.toml"
    toml.write_text(text + "\n")
    ns = parse_train_args(["--config", str(toml)])
    assert {k: getattr(ns, k) for k in expected} == expected
    assert ns.config_file_keys == set(expected)


def test_config_file_values_are_not_overridden_by_demo_defaults(tmp_path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("train_iters = 7\nlr = 5e-4\n")
    assert main(["train", "--demo", "--config", str(toml), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "\ntrain_iters = 7\n" in out and "\nlr = 0.0005\n" in out


NUMERIC_CASES = [
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "1e3"], "--lr"),
    (["--min-lr", "-1"], "--min-lr"),
    (["--adam-beta1", "1"], "--adam-beta1"),
    (["--adam-beta2", "-0.5"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--clip-grad", "-1"], "--clip-grad"),
    (["--clip-grad", "inf"], "--clip-grad"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--hidden-dropout", "1"], "--hidden-dropout"),
    (["--hidden-dropout", "nan"], "--hidden-dropout"),
    (["--valid-fraction", "inf"], "--valid-fraction"),
    (["--initial-loss-scale", "inf"], "--initial-loss-scale"),
    (["--straggler-threshold", "inf"], "--straggler-threshold"),
    (["--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff"),
    (["--moe-expert-capacity-factor", "inf"], "--moe-expert-capacity-factor"),
    (["--exit-duration-in-mins", "inf"], "--exit-duration-in-mins"),
    (["--inprocess-soft-timeout", "nan"], "--inprocess-soft-timeout"),
    (["--inject-fault-hang-seconds", "inf"], "--inject-fault-hang-seconds"),
    (["--distributed-timeout-minutes", "nan"], "--distributed-timeout-minutes"),
    (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes"),
    (["--distributed-timeout-minutes", "1e9"], "--distributed-timeout-minutes"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "1e30"], "--seed"),
    (["--seed", "4294967296"], "--seed"),
    (["--micro-batch-size", "1e9"], "--micro-batch-size"),
    (["--train-iters", "1.5"], "--train-iters"),
    (["--train-iters", "9" * 30], "--train-iters"),
    (["--train-iters", "9" * 5000], "--train-iters"),
    (["--save-interval", "-1"], "--save-interval"),
    (["--log-interval", "-5"], "--log-interval"),
    (["--eval-iters", "-1"], "--eval-iters"),
    (["--timing-log-level", "7"], "--timing-log-level"),
    (["--timing-log-option", "median"], "--timing-log-option"),
    (["--profile-ranks", "-1"], "--profile-ranks"),
    (["--data-path", "inf", "a.bin", "1", "b.bin"], "--data-path"),
    (["--data-path", "1e308", "a.bin", "1e308", "b.bin"], "--data-path"),
    (["--train-iter", "5"], "unrecognized arguments: --train-iter"),  # no abbreviations
    (["--conf", "x.toml"], "unrecognized arguments: --conf"),
]


@pytest.mark.parametrize(
    ("args", "flag"), NUMERIC_CASES, ids=[" ".join(c[0])[:40] for c in NUMERIC_CASES]
)
def test_non_finite_and_absurd_values_are_refused_up_front(capsys, tmp_path, args, flag) -> None:
    _refused(capsys, tmp_path, args, [flag])


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["--micro-batch-size", "1000000000"], ["--micro-batch-size 1000000000", "--seq-length"]),
        (["--ffn-hidden-size", "1000000000000"], ["--ffn-hidden-size 1000000000000"]),
        (["--hidden-size", "2000000", "--num-attention-heads", "2"], ["--hidden-size 2000000"]),
        (["--vocab-size", "4000000000"], ["--vocab-size 4000000000"]),
    ],
)
def test_what_cannot_fit_in_memory_is_refused_before_allocating(
    capsys, tmp_path, args, flags
) -> None:
    err = _refused(capsys, tmp_path, args, [*flags, "does not fit in memory", "GiB available"])
    assert "theoretical estimate" in err


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "nan"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "inf"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "9" * 40}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "\udcff\udcfe"}, "LOCAL_RANK"),  # bytes that are not UTF-8
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
        ({"RANK": "1e3"}, "RANK"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT"),
        ({"STALWART_INPROCESS_PORT": "abc"}, "STALWART_INPROCESS_PORT"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT"),
        ({"STALWART_DEVICE_ID": "gpu 0"}, "STALWART_DEVICE_ID"),
        ({"STALWART_DEVICE_ID": "gpu0\nrank=9"}, "STALWART_DEVICE_ID"),
        ({"SLURM_JOB_ID": "\udcff"}, "SLURM_JOB_ID"),
    ],
)
def test_bad_environment_variables_are_one_line(capsys, tmp_path, monkeypatch, env, name) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _refused(capsys, tmp_path, [], [f"environment variable {name}="])


def test_distributed_timeout_nan_on_two_ranks_names_the_flag(tmp_path) -> None:
    # Two ranks with torchrun's environment, forked from the fork server (no torch import each).
    argv = _train("--save", str(tmp_path / "ckpt"), "--distributed-timeout-minutes", "nan")
    proc = run_cli_on_ranks(argv, tmp_path / "logs")
    assert proc.codes == [2, 2], proc.stderr  # what torchrun reports as each worker's exitcode
    ours = [line for line in proc.stderr.splitlines() if line.startswith("stalwart train:")]
    assert len(ours) == 2, proc.stderr  # one line per rank
    assert all("--distributed-timeout-minutes" in line for line in ours)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--out", "x.html", "run"],
        ["checkpoints", "--verif", "ckpt"],
        ["export", "--lo", "ckpt", "--out", "x.pt"],
        ["chaos", "--iter", "3"],
    ],
)
def test_subcommands_refuse_abbreviated_flags(argv: list[str], tmp_path, capsys) -> None:
    # In process (the exit code main() returns, what it printed): a subprocess per case spent
    # ~4 s of CPU importing torch to print one argparse line.
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "unrecognized arguments" in err or "the following arguments" in err
    assert len(err.strip().splitlines()) == 1, err


def test_tracker_file_with_a_non_utf8_line_is_skipped_and_the_job_runs(tmp_path) -> None:
    tracker = tmp_path / "rejected.txt"
    good = (
        "ts=2026-01-01 00:00:00 node=n device=0 jobID={job} rank=0 iteration=2 "
        "status=rerun_disabled result=nan message='Unexpected result'\n"
    )
    tracker.write_bytes(
        good.format(job="a").encode() + b"\xff\xfe torn \x80\n" + good.format(job="b").encode()
    )
    proc = _job(
        tmp_path / "logs5", "--result-rejected-tracker-filename", str(tracker), "--train-iters", "3"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("Skipped 1 unreadable line(s) of tracker file") == 1, proc.stderr
    assert "Will skip these iterations from tracker file: [2]" in proc.stderr
