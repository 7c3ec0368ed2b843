"""Megatron's non-persistent checkpoint flags (issue 43): each is accepted with its meaning, or
refused with exit 2 and one line naming the flag and what would work."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpoint.non_persistent import LocalAlgo, NonPersistentType
from stalwart.cli.main import main

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, make_config

LOCAL = [
    "--save",
    "/tmp/s",
    "--non-persistent-save-interval",
    "2",
    "--non-persistent-ckpt-type",
    "local",
]


def _train(*args: str) -> list[str]:
    return ["train", *TINY_FLAGS, "--train-iters", "2", *args]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--non-persistent-ckpt-type", "memory"], "--non-persistent-ckpt-type: invalid choice"),
        (
            [
                *["--save", "/tmp/s", "--non-persistent-ckpt-type", "local"],
                *["--non-persistent-local-ckpt-dir", "/tmp/l"],
            ],
            "needs --non-persistent-save-interval",
        ),
        (LOCAL, "local needs --non-persistent-local-ckpt-dir"),
        ([*LOCAL, "--non-persistent-local-ckpt-dir", "/tmp/s"], "same directory as --save"),
        (
            [
                *LOCAL,
                "--non-persistent-local-ckpt-dir",
                "/tmp/l",
                "--non-persistent-ckpt-dir",
                "/tmp/g",
            ],
            "--non-persistent-ckpt-dir (--non-persistent-global-ckpt-dir) is the global",
        ),
        (
            ["--non-persistent-local-ckpt-dir", "/tmp/l"],
            "applies to --non-persistent-ckpt-type local",
        ),
        (
            ["--non-persistent-local-ckpt-algo", "atomic"],
            "--non-persistent-local-ckpt-algo applies",
        ),
        (["--non-persistent-local-ckpt-algo", "fast"], "--non-persistent-local-ckpt-algo: invalid"),
        (["--replication"], "--replication applies to --non-persistent-ckpt-type local"),
        (
            [*LOCAL, "--non-persistent-local-ckpt-dir", "/tmp/l", "--replication-jump", "2"],
            "--replication-jump applies with --replication",
        ),
        (
            [
                *LOCAL,
                "--non-persistent-local-ckpt-dir",
                "/tmp/l",
                "--replication",
                "--replication-factor",
                "1",
            ],
            "--replication-factor must be >= 2",
        ),
        (
            [
                *LOCAL,
                "--non-persistent-local-ckpt-dir",
                "/tmp/l",
                "--replication",
                "--replication-jump",
                "0",
            ],
            "--replication-jump must be > 0",
        ),
        (["--replication-factor", "-2"], "--replication-factor"),
        (
            [
                "--save",
                "/tmp/s",
                "--non-persistent-save-interval",
                "2",
                "--non-persistent-ckpt-type",
                "in_memory",
            ],
            "in_memory needs --inprocess-restart",
        ),
    ],
)
def test_bad_non_persistent_flags_exit_2_with_one_line(capsys, args, needle) -> None:
    assert main(_train(*args)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_megatron_spellings_mean_what_they_say() -> None:
    """What a Megatron launch script passes: the global type under its own directory flag, and
    the local type with replicas."""
    glob = make_config(
        "--save",
        "/tmp/s",
        "--non-persistent-save-interval",
        "2",
        "--non-persistent-ckpt-type",
        "global",
        "--non-persistent-global-ckpt-dir",
        "/tmp/np",
    ).checkpoint
    assert glob.non_persistent_ckpt_type is NonPersistentType.GLOBAL
    assert glob.non_persistent_ckpt_dir == "/tmp/np"
    local = make_config(
        *LOCAL,
        "--non-persistent-local-ckpt-dir",
        "/tmp/l",
        "--replication",
        "--replication-jump",
        "8",
        "--replication-factor",
        "3",
        "--non-persistent-local-ckpt-algo",
        "atomic",
    ).checkpoint
    assert local.non_persistent_ckpt_type is NonPersistentType.LOCAL
    assert local.non_persistent_local_ckpt_algo is LocalAlgo.ATOMIC
    assert (local.replication, local.replication_jump, local.replication_factor) == (True, 8, 3)
    memory = make_config(
        "--save",
        "/tmp/s",
        "--non-persistent-save-interval",
        "2",
        "--non-persistent-ckpt-type",
        "in_memory",
        "--inprocess-restart",
    ).checkpoint
    assert memory.non_persistent_ckpt_type is NonPersistentType.IN_MEMORY


def test_replicas_that_cannot_leave_the_node_are_one_warning(tmp_path: Path) -> None:
    """One rank on one node (a job an exclusion shrank, or a single-node job): no other node
    for a second copy. The job runs with its local copies, and one line says so."""
    args = _train(
        "--save",
        str(tmp_path / "s"),
        "--non-persistent-save-interval",
        "1",
        "--non-persistent-ckpt-type",
        "local",
        "--replication",
        "--non-persistent-local-ckpt-dir",
        str(tmp_path / "l"),
    )
    proc = run_cli_on_ranks(args, tmp_path / "logs", world_size=1)
    assert proc.returncode == 0, proc.log[-2000:]
    warned = [line for line in proc.log.splitlines() if "--replication:" in line]
    assert len(warned) == 1 and "only 1 node(s), not --replication-factor 2" in warned[0]
    assert (tmp_path / "l" / "rank_00000" / "iter_0000001" / "shard_00000").is_dir()
