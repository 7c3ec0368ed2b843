"""Hostile-input audit, round 2: the other subcommands, ``--config`` files, ``STALWART_*``
variables and data files. Every case is exit code 2 and one line naming the flag, variable or
file (never a traceback, a hang or a silently different run).

All in-process (``main(argv)``) and refused before a model is built; round 1 is
``test_hostile_input.py``. ``FOUND`` are the cases the audit found wrong (the comment says how),
``PINNED`` were already refused and stay so.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stalwart.cli.main import main

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "16", "--vocab-size", "512", "--micro-batch-size", "2",
    "--train-iters", "1", "--use-cpu",
]  # fmt: skip
# Megatron's index header: magic, uint64 version 1, dtype code 4 (int32).
INT32_IDX = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4]) + bytes(16)


class Hung(BaseException):
    """Raised by the alarm: not an OSError (TimeoutError is one), so no reader swallows it."""


@pytest.fixture
def d(tmp_path: Path) -> Iterator[Path]:
    """Files for the cases; every case must end within 60 s (a FIFO read used to hang forever)."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "goodput.jsonl")
    toml = {
        "deep_inline.toml": "a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n",
        "deep_array.toml": "lr = " + "[" * 3000 + "]" * 3000 + "\n",
        "deep_tables.toml": "[" + ".".join(["t"] * 20) + "]\nlr = 1e-3\n",
        "experts0.toml": "num_experts = 0\n",
        "empty.toml": "",
        "dup.toml": "train_iters = 2\ntrain_iters = 3\n",
        "bom.toml": "\ufefftrain_iters = 2\n",
        "big_int.toml": "train_iters = " + "9" * 50 + "\n",
    }
    for name, text in toml.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "utf16.toml").write_bytes("train_iters = 2\n".encode("utf-16"))
    with open(tmp_path / "huge.toml", "wb") as f:
        f.truncate(17 << 20)  # sparse: no 17 MiB written
    tokens = np.arange(4000, dtype=np.uint16) % 512
    tokens.tofile(tmp_path / "int32.bin")
    (tmp_path / "int32.idx").write_bytes(INT32_IDX)
    tokens.tofile(tmp_path / "plain.bin")

    def hang(*_: object) -> None:
        raise Hung("the case hung (a FIFO read?)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)  # generous: a loaded CI machine imports torch._inductor slowly
    yield tmp_path
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


T = ["train", *TINY]
FOUND = [
    # A traceback from torch.compile after the model was built.
    ([*T, "--compile", "--inductor-config", "max_autotune=None"], "max_autotune: Inductor's option takes True or False"),
    # Trained a dense model (Megatron: omit the flag for dense), and MoE settings were ignored.
    ([*T, "--num-experts", "0"], "--num-experts: must be an integer >= 1"),
    ([*T, "--config", "{d}/experts0.toml"], "--num-experts"),
    ([*T, "--moe-router-topk", "1"], "--moe-router-topk needs --num-experts"),
    ([*T, "--moe-aux-loss-coeff", "0.1", "--moe-expert-capacity-factor", "2"], "--moe-expert-capacity-factor need --num-experts"),
    # --config: RecursionError tracebacks; an empty path or a second file ignored silently.
    ([*T, "--config", "{d}/deep_inline.toml"], "deep_inline.toml: values nested too deeply"),
    ([*T, "--config", "{d}/deep_array.toml"], "deep_array.toml: values nested too deeply"),
    ([*T, "--config", "{d}/deep_tables.toml"], "tables nested deeper than 8"),
    ([*T, "--config", ""], "--config is empty"),
    ([*T, "--config", "{d}/empty.toml", "--config={d}/empty.toml"], "--config given twice"),
    # --data-dtype ignored for text and the corpus; a Megatron .bin read with the wrong dtype.
    ([*T, "--data-dtype", "uint32"], "--data-dtype uint32 applies to .bin files only"),
    ([*T, "--data-path", "{d}/a_file", "--data-dtype", "uint32"], "applies to .bin files only"),
    ([*T, "--data-path", "{d}/int32.bin"], "index int32.idx says the tokens are int32, not --data-dtype uint16 (pass --data-dtype uint32)"),
    ([*T, "--data-path", "{d}/int32.idx"], "is a Megatron index, not tokens: pass {d}/int32.bin"),
    ([*T, "--data-path", "{d}/int32"], "a Megatron prefix? pass {d}/int32.bin"),
    # A FIFO as --metrics-file: accepted, then the first append blocked.
    ([*T, "--metrics-file", "{d}/fifo"], "--metrics-file '{d}/fifo' is not a regular file"),
    # ... or planted in the run or save directory under a file the run appends to.
    ([*T, "--run-dir", "{d}/run"], "--run-dir '{d}/run': goodput.jsonl is not a regular file"),
    ([*T, "--save", "{d}/run"], "--save '{d}/run': goodput.jsonl is not a regular file"),
    # Poor messages: "error:  is not a directory".
    (["checkpoints", ""], "SAVE_DIR is empty"),
    (["checkpoints", "{d}/nope"], "SAVE_DIR '{d}/nope' does not exist"),
    (["checkpoints", "convert", "--trust-pickle", ""], "PATH is empty"),
    (["export", "--load", "", "--out", "{d}/o.pt"], "--load is empty"),
    # export: --out checked after the model was loaded (a directory: OSError after the work).
    (["export", "--load", "{d}/a_dir", "--out", "{d}/a_dir"], "--out '{d}/a_dir' is a directory"),
    # report '' wrote ./report.html of the working directory; --metrics-file a directory or a
    # FIFO: a report without metrics, exit 0 (a FIFO: a hang).
    (["report", "", "--no-png"], "RUN_DIR is empty"),
    (["report", "{d}/a_dir", "--no-png", "--metrics-file", "{d}/a_dir"], "--metrics-file '{d}/a_dir' is not a readable file"),
    (["report", "{d}/a_dir", "--no-png", "--metrics-file", "{d}/fifo"], "--metrics-file"),
    # goodput: a FIFO ledger hung; '' read the working directory.
    (["goodput", "{d}/run"], "goodput.jsonl is not a regular file"),
    (["goodput", ""], "RUN_DIR is empty"),
    # chaos: --faults '' (an unset shell variable) ran every fault; --work-dir a file was a
    # traceback; --json a directory was a traceback after the whole campaign.
    (["chaos", "--faults", ""], "--faults is empty"),
    (["chaos", "--faults", "hang", "--work-dir", "{d}/a_file"], "--work-dir '{d}/a_file' is a file"),
    (["chaos", "--faults", "hang", "--json", "{d}/a_dir"], "--json '{d}/a_dir' is a directory"),
    (["chaos", "--faults", "hang", "--json", "{d}/a_file/x.json"], "--json"),
]  # fmt: skip

PINNED = [
    ([*T, "--config", "{d}/dup.toml"], "Cannot overwrite a value"),
    ([*T, "--config", "{d}/bom.toml"], "bom.toml"),
    ([*T, "--config", "{d}/utf16.toml"], "utf16.toml"),
    ([*T, "--config", "{d}/big_int.toml"], "--train-iters"),
    ([*T, "--config", "{d}/huge.toml"], "larger than 16 MiB"),
    ([*T, "--config", "{d}/fifo"], "not a regular file"),
    ([*T, "--config", "/dev/zero"], "not a regular file"),
    ([*T, "--data-path", "{d}/fifo"], "--data-path"),
    ([*T, "--data-path", "{d}/a_dir"], "--data-path"),
    (["checkpoints", "{d}/a_file"], "is not a directory"),
    (["checkpoints"], "required: save_dir"),
    (["checkpoints", "convert", "{d}/a_dir"], "--trust-pickle is required"),
    (["export", "--load", "{d}/a_dir", "--out", "{d}/o.pt", "--iteration", "-1"], "--iteration"),
    (["export", "--load", "{d}/a_dir", "--out", "{d}/o.pt", "--iteration", "9007199254740992"], "directory is missing"),
    (["report", "{d}/nope", "--no-png"], "run directory not found"),
    (["goodput", "{d}/a_file"], "is not a directory"),
    (["chaos", "--faults", "bogus"], "unknown fault 'bogus'"),
    (["chaos", "--faults", "hang", "--iterations", "0"], "--iterations"),
    (["chaos", "--faults", "hang", "--nproc-per-node", "1"], "--nproc-per-node"),
    (["chaos", "--faults", "hang", "--timeout", "nan"], "--timeout"),
    (["convert"], "unknown command 'convert'"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needle"), FOUND + PINNED, ids=lambda v: None)
def test_bad_input_is_exit_2_and_one_line(
    capsys: pytest.CaptureFixture[str], d: Path, argv: list[str], needle: str
) -> None:
    err = _one_line(capsys, [a.format(d=d) for a in argv])
    assert needle.format(d=d) in err, err


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        # found: a file there rebuilt the corpus at every start without a word
        ({"STALWART_CACHE": "{d}/a_file"}, "environment variable STALWART_CACHE '{d}/a_file' is a file"),
        ({"STALWART_CACHE": "{d}/a_file/sub"}, "environment variable STALWART_CACHE"),
        ({"STALWART_DEVICE_ID": "a b"}, "STALWART_DEVICE_ID"),
        ({"STALWART_JOB_ID": "x" * 300}, "STALWART_JOB_ID"),
        ({"STALWART_INPROCESS_PORT": "0"}, "STALWART_INPROCESS_PORT"),
    ],
)  # fmt: skip
def test_bad_stalwart_variables_are_exit_2(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    d: Path,
    env: dict[str, str],
    needle: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(d=d))
    assert needle.format(d=d) in _one_line(capsys, T)


def test_what_the_new_refusals_still_accept(d: Path) -> None:
    """The refusals are exact: a matching .idx, an Optional Inductor option set to None, a
    cache directory that can be created, an empty --config file and MoE flags with experts."""
    from stalwart.cli.args import parse_train_args
    from stalwart.config.inductor import parse_inductor_options
    from stalwart.config.paths import check_output_dir
    from stalwart.data.datasets import load_tokens

    (d / "int32.bin").unlink()
    np.arange(100, dtype=np.uint32).tofile(d / "int32.bin")
    assert load_tokens(str(d / "int32.bin"), "uint32")[-1] == 99
    assert load_tokens(str(d / "plain.bin"), "uint16").shape == (4000,)  # no index: as before
    import torch._inductor.config as inductor_config

    optional = next(
        (k for k, v in inductor_config.get_config_copy().items() if v is None), None
    )  # an option whose default is None takes None
    if optional is not None:
        assert parse_inductor_options([f"{optional}=None"]) == {optional: None}
    check_output_dir("environment variable STALWART_CACHE", str(d / "new" / "cache"))
    ns = parse_train_args([*TINY, "--config", str(d / "empty.toml"), "--num-experts", "2"])
    assert ns.num_experts == 2 and ns.config_file_keys == frozenset()
