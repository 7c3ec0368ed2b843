"""A typical Megatron ``pretrain_gpt.py`` flag set (docs/migration-megatron.md, scaled to tiny
sizes): every row runs or is refused in one line naming its flag; the accepted rows train."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from stalwart.cli.main import main

from train_utils import REPO

# (flags, refused?) in the order of the migration page's table.
ROWS: list[tuple[str, bool]] = [
    ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32", False),
    ("--max-position-embeddings 32", False),
    ("--ffn-hidden-size 96 --swiglu --normalization RMSNorm --norm-epsilon 1e-5", False),
    ("--position-embedding-type rope --rotary-base 500000", False),
    ("--use-rope-scaling --rope-scaling-factor 32", False),
    ("--untie-embeddings-and-output-weights --disable-bias-linear", False),
    ("--group-query-attention --num-query-groups 2", False),
    ("--attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02", False),
    ("--use-flash-attn --no-masked-softmax-fusion --attention-backend auto", False),
    ("--micro-batch-size 2 --global-batch-size 4 --train-iters 4", False),
    ("--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 4", False),
    ("--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0", False),
    ("--bf16 --seed 1234", False),
    ("--overlap-grad-reduce --accumulate-allreduce-grads-in-fp32", False),
    ("--tokenizer-type NullTokenizer --vocab-size 512 --make-vocab-size-divisible-by 128", False),
    ("--data-path tokens.bin", False),
    ("--save ckpt --load ckpt --save-interval 2", False),
    ("--non-persistent-save-interval 1 --non-persistent-ckpt-type global --non-persistent-global-ckpt-dir np", False),
    ("--eval-interval 2 --eval-iters 1 --log-interval 1", False),
    ("--tensorboard-dir tb --tensorboard-queue-size 1 --log-timers-to-tensorboard", False),
    ("--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-throughput", False),
    ("--distributed-backend nccl --distributed-timeout-minutes 10", False),
    ("--exit-duration-in-mins 230 --manual-gc", False),
    ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1", False),
    ("--tensor-model-parallel-size 8", True),
    ("--pipeline-model-parallel-size 16", True),
    ("--sequence-parallel", True),
    ("--use-distributed-optimizer", True),
    ("--overlap-param-gather", True),
    ("--transformer-impl transformer_engine", True),
    ("--use-mcore-models", True),
    ("--tokenizer-type GPT2BPETokenizer", True),
    ("--vocab-file gpt2-vocab.json", True),
    ("--merge-file gpt2-merges.txt", True),
    ("--split 949,50,1", True),
    ("--lr-warmup-fraction 0.01", True),
    ("--ckpt-format torch_dist", True),
    ("--recompute-activations", True),
    ("--attention-softmax-in-fp32", True),
    ("--fp8-format hybrid", True),
]  # fmt: skip
BASE = ["--use-cpu", "--no-progress-bar", "--preset", "llama-tiny"]
ACCEPTED = [flag for flags, refused in ROWS if not refused for flag in flags.split()]


def _in(tmp: Path, flags: list[str]) -> list[str]:
    """The flags with their file names under ``tmp``."""
    names = {"tokens.bin", "ckpt", "tb", "np"}
    return [str(tmp / f) if f in names else f for f in flags]


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    rng.integers(0, 512, size=20_000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    return tmp_path


def test_the_flag_set_is_about_forty_megatron_flags() -> None:
    flags = {f for flags, _ in ROWS for f in flags.split() if f.startswith("--")}
    assert len(flags) >= 40


def test_the_migration_page_lists_every_row() -> None:
    page = (REPO / "docs" / "migration-megatron.md").read_text()
    for flags, refused in ROWS:
        (row,) = [line for line in page.splitlines() if line.startswith(f"| `{flags}` |")]
        assert row.split("|")[2].strip().startswith("refused" if refused else "runs"), row


@pytest.mark.parametrize(("flags", "refused"), ROWS, ids=[r[0] for r in ROWS])
def test_each_row_runs_or_is_refused_with_its_reason(
    tokens: Path, capsys: pytest.CaptureFixture[str], flags: str, refused: bool
) -> None:
    argv = ["train", *BASE, *_in(tokens, ACCEPTED), *_in(tokens, flags.split()), "--print-config"]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    if not refused:
        assert code == 0, err
        return
    flag = flags.split()[0]
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(
        rf"{re.escape(flag)} is a Megatron flag stalwart does not implement \(.+\)", err
    ), err


def test_the_accepted_flags_train(tokens: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *BASE, *_in(tokens, ACCEPTED)]) == 0
    out = capsys.readouterr().out
    assert "iteration 4/4 |" in out and "validation at iteration 2 |" in out  # compact lines
    assert (tokens / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert list((tokens / "tb").iterdir())  # TensorBoard events written


def test_the_page_says_why_each_accepted_switch_holds() -> None:
    from stalwart.cli.megatron_flags import ALWAYS

    page = (REPO / "docs" / "migration-megatron.md").read_text()
    for always in ALWAYS:
        assert f"| `{always.flag}` | {always.fact} |" in page, always.flag
