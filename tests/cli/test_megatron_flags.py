"""Megatron users at home: Megatron's spellings work and do what Megatron's flags do; the Megatron
flags stalwart does not implement are refused in one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.cli.args import parse_train_args
from stalwart.cli.main import main
from stalwart.cli.megatron_flags import UNSUPPORTED
from stalwart.config.run import build_run_config
from stalwart.distributed.process_group import DistributedContext
from stalwart.observability.progress_log import cumulative_start
from stalwart.reliability.inprocess.wrapper import RestartOptions
from stalwart.train.trainer import Trainer, run_training

from train_utils import TINY_FLAGS, make_config

REFUSED = "is a Megatron flag stalwart does not implement"


def _run_config(*argv: str) -> dict[str, object]:
    args = [*TINY_FLAGS, *argv]
    return build_run_config(parse_train_args(args), args).to_dict()


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    code = main(["train", *TINY_FLAGS, *argv, "--print-config"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{flag} {REFUSED} (" in err, err


@pytest.mark.parametrize("u", UNSUPPORTED, ids=[u.flag for u in UNSUPPORTED])
def test_every_unimplemented_megatron_flag_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], u
) -> None:
    value = ["2"] if u.takes_value else []
    _refused(capsys, [u.flag, *value], u.flag)
    if u.takes_value:
        _refused(capsys, [f"{u.flag}=hybrid"], u.flag)  # the = spelling too
        _refused(capsys, [u.flag], u.flag)  # without its value


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-model-parallel-size", "1"],
        ["--pipeline-model-parallel-size=1"],
        ["--context-parallel-size", "1", "--expert-model-parallel-size", "1"],
        ["--attention-dropout", "0.0"],
        ["--optimizer", "adam"],
        ["--transformer-impl", "local"],
    ],
)
def test_megatron_values_that_mean_off_are_accepted_and_change_nothing(argv: list[str]) -> None:
    assert _run_config(*argv) == _run_config()


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("tensor_model_parallel_size = 1", True),
        ("tensor-model-parallel-size = 2", False),
        ("sequence_parallel = false", True),
        ("sequence_parallel = true", False),
        ('fp8_format = "hybrid"', False),
        ("attention_dropout = 0.0", True),
        ("use_flash_attn = true", True),  # its effect holds: accepted
        ("overlap_grad_reduce = true", True),
    ],
)
def test_config_file_keys_follow_the_same_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, ok: bool
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    code = main(["train", *TINY_FLAGS, "--config", str(path), "--print-config"])
    err = capsys.readouterr().err.strip()
    if ok:
        assert code == 0, err
    else:
        assert code == 2 and len(err.splitlines()) == 1 and REFUSED in err and str(path) in err


@pytest.mark.parametrize(
    ("megatron", "ours"),
    [
        (["--enable-ft-package"], ["--enable-ft"]),
        (
            ["--num-experts", "2", "--moe-capacity-factor", "2.0"],
            ["--num-experts", "2", "--moe-expert-capacity-factor", "2.0"],
        ),
    ],
)
def test_megatron_spelling_is_the_same_flag(megatron: list[str], ours: list[str]) -> None:
    assert _run_config(*megatron) == _run_config(*ours) != _run_config(*megatron[:-2])


def test_inprocess_flags_reach_the_restarter() -> None:
    config = make_config(
        "--inprocess-heartbeat-timeout", "12", "--inprocess-barrier-timeout", "45",
        "--inprocess-monitor-thread-interval", "0.2", "--inprocess-empty-cuda-cache",
    )  # fmt: skip
    options = RestartOptions.from_config(config.inprocess)
    assert (options.heartbeat_timeout, options.barrier_timeout) == (12.0, 45.0)
    times = options.monitor_times()
    assert (times.heartbeat_timeout, times.poll_interval) == (12.0, 0.2)
    default = RestartOptions.from_config(make_config().inprocess).monitor_times()
    assert default.heartbeat_timeout == 60.0  # --inprocess-soft-timeout when unset


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--inprocess-heartbeat-timeout", "0.5"], "--inprocess-heartbeat-timeout must be >"),
        (["--inprocess-monitor-thread-interval", "0"], "--inprocess-monitor-thread-interval"),
        (["--inprocess-barrier-timeout", "0"], "--inprocess-barrier-timeout"),
        (["--straggler-minmax-count", "0"], "--straggler-minmax-count"),
        (["--save-dgrads-interval", "-1"], "--save-dgrads-interval"),
        (["--log-progress"], "--log-progress needs --save"),
    ],
)
def test_new_megatron_flags_check_their_values(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code = main(["train", *TINY_FLAGS, *argv, "--print-config"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_no_log_loss_scale_to_tensorboard_turns_it_off() -> None:
    assert make_config().shell.log.log_loss_scale_to_tensorboard is True
    assert (
        make_config("--no-log-loss-scale-to-tensorboard").shell.log.log_loss_scale_to_tensorboard
        is False
    )


def _dumps(tmp_path: Path, name: str, *flags: str) -> Path:
    dump = tmp_path / name
    run_training(
        make_config("--train-iters", "4", "--seed", "3", "--dump-dir", str(dump), *flags),
        DistributedContext(),
    )
    return dump


def _iters(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_save_dgrads_interval_dumps_dgrads_every_n_iterations_as_log_dgrads_does(
    tmp_path: Path,
) -> None:
    megatron = _dumps(tmp_path, "megatron", "--save-dgrads-interval", "2")
    assert _iters(megatron / "dgrads") == ["iter_0000002", "iter_0000004"]
    assert not (megatron / "activations").exists()  # only what the flag asks for
    ours = _dumps(tmp_path, "ours", "--log-dgrads", "--save-activations-interval", "2")
    assert _iters(ours / "dgrads") == _iters(megatron / "dgrads")
    for it in _iters(ours / "dgrads"):
        a = torch.load(megatron / "dgrads" / it / "rank0.pt", weights_only=True)
        b = torch.load(ours / "dgrads" / it / "rank0.pt", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_tokens_per_expert_interval_records_every_micro_batch(tmp_path: Path) -> None:
    moe = ["--num-experts", "2", "--global-batch-size", "8"]  # 2 micro-batches of 4
    dump = _dumps(tmp_path, "tpe", *moe, "--save-tokens-per-expert-interval", "3")
    records = [json.loads(line) for line in (dump / "tokens_per_expert" / "rank0.jsonl").open()]
    assert {r["iter"] for r in records} == {3}
    assert all(r["block"] == "decoder" and len(r["tpe"]) == 2 for r in records)  # per micro-batch
    tokens = 4 * 32 * 2  # micro batch x sequence x top-2 routing
    assert all(sum(mb) == tokens for r in records for mb in r["tpe"]), records


def test_straggler_minmax_count_reaches_the_detector() -> None:
    config = make_config("--log-straggler", "--straggler-minmax-count", "3")
    with Trainer(config, DistributedContext()) as trainer:
        assert trainer.shell.observer.straggler.minmax_count == 3  # type: ignore[union-attr]


def test_log_progress_writes_megatrons_progress_file(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = ["--save", str(save), "--save-interval", "2", "--log-progress"]
    run_training(make_config("--train-iters", "4", *flags), DistributedContext())
    run_training(make_config("--train-iters", "6", "--lr-decay-iters", "4", *flags),
                 DistributedContext())  # fmt: skip
    lines = (save / "progress.txt").read_text().splitlines()
    events = [line.split("\t")[3] for line in lines]
    assert events == ["Starting job", "Saved checkpoint", "Saved checkpoint",
                      "Starting job", "Saved checkpoint"]  # fmt: skip
    saved = [dict(t.split(": ", 1) for t in line.split("\t")[1:] if ": " in t) for line in lines]
    assert [s.get("Iteration") for s in saved if "Iteration" in s] == ["2", "4", "6"]
    flops = [float(s["Floating-point operations"]) for s in saved if "Iteration" in s]
    assert (
        flops[0] > 0
        and flops[1] == pytest.approx(2 * flops[0])
        and flops[2] == pytest.approx(3 * flops[0])
    )
    assert all(
        s["# GPUs"] == "1" and s["Job throughput"].endswith("TFLOP/s/GPU") for s in saved[1:2]
    )
    # Megatron's reading of the file: the first start of this world size, at 0 operations.
    start, start_flops = cumulative_start(lines, world_size=1)
    assert start is not None and start_flops == 0.0
    assert cumulative_start(lines, world_size=8) == (None, 0.0)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["train", *TINY_FLAGS, *argv, "--print-config"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["--use-flash-attn"],
        ["--overlap-grad-reduce"],
        ["--accumulate-allreduce-grads-in-fp32", "--no-masked-softmax-fusion"],
        ["--max-position-embeddings", "32"],  # = --seq-length of TINY_FLAGS
        ["--kv-channels", "32"],  # 64 / 2 heads
        ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"],
        ["--make-vocab-size-divisible-by", "128"],  # 512 is a multiple
        ["--distributed-backend", "nccl", "--tokenizer-type", "NullTokenizer"],
    ],
)
def test_megatron_flags_whose_effect_holds_are_accepted(argv: list[str]) -> None:
    extra = argv[-2:] if "--hidden-dropout" in argv else []
    assert _run_config(*argv) == _run_config(*extra)


def test_max_position_embeddings_follows_how_the_model_uses_positions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _error(capsys, "--max-position-embeddings", "16")
    assert "--max-position-embeddings (16) must be >= --seq-length (32)" in err
    err = _error(capsys, "--max-position-embeddings", "64")  # learned: a bigger table
    assert "learned position table has --seq-length rows" in err
    assert "--max-position-embeddings 32" in err
    # RoPE has no table: any value >= --seq-length describes the same model.
    rope = ["--position-embedding-type", "rope"]
    assert _run_config(*rope, "--max-position-embeddings", "4096") == _run_config(*rope)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-channels", "16"], "--kv-channels 16: stalwart's head size is --hidden-size / --num-attention-heads = 32"),
        (["--attention-dropout", "0.1"], "--attention-dropout 0.1 differs from --hidden-dropout 0.0"),
        (["--make-vocab-size-divisible-by", "100"], "pass --vocab-size 600"),
    ],
)  # fmt: skip
def test_megatron_values_that_would_differ_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert needle in _error(capsys, *argv)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--trian-iters", "5"], "unrecognized arguments: --trian-iters (did you mean --train-iters?)"),
        (["--train-iter=5"], "--train-iter (did you mean --train-iters?)"),
        (["--lr-warmup-iter", "2"], "did you mean --lr-warmup-iters?"),
        (["--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size?"),
        (["--frobnicate"], "--frobnicate (neither a stalwart flag nor a Megatron flag"),
    ],
)  # fmt: skip
def test_unknown_flags_are_named_with_did_you_mean(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    err = _error(capsys, *argv)
    assert needle in err, err
    assert "'5'" not in err and "'2'" not in err  # an unknown flag's value is not a second error
