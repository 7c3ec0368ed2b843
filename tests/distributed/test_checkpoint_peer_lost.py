"""A rank that goes away during an async checkpoint commit (issue 29, item 7): the survivor says
in one line which rank went away and which checkpoint is kept, and nothing is lost."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stalwart.checkpoint import layout
from stalwart.checkpoint.commit import PendingSave, SaveSteps
from stalwart.checkpoint.errors import PeerLostError
from stalwart.checkpoint.lock import SaveDirLocks
from stalwart.cli.main import main

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS

pytestmark = [pytest.mark.distributed]

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:29852. This is typically caused by a remote worker crashing."
)


def test_rank_0_killed_in_the_async_commit_window(tmp_path: Path) -> None:
    save = tmp_path / "save"
    args = ["train", *TINY_FLAGS, "--train-iters", "6", "--save", str(save),
            "--save-interval", "2", "--async-save",
            "--inject-fault", "sigkill", "--inject-fault-phase", "commit",
            "--inject-fault-iteration", "4", "--inject-fault-rank", "0"]  # fmt: skip
    exits = run_cli_on_ranks(args, tmp_path / "logs", world_size=2, timeout_s=150)
    assert exits.codes == [-9, 1], exits.log[-3000:]
    err = (tmp_path / "logs" / "rank1.err").read_text()
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    # gloo's own words for the lost socket vary ("Connection closed by peer", "Read error ...:
    # Connection reset by peer"); the line quotes them in parentheses.
    assert last.startswith("stalwart train: rank 0 went away during the commit of checkpoint "
                           "iteration 4 ("), last  # fmt: skip
    assert "the last committed checkpoint, iteration 2, is kept in" in last
    assert layout.read_tracker(str(save)) == 2  # nothing lost: 2 is whole and verifies
    assert main(["checkpoints", str(save), "--verify"]) == 0


def _steps(rank: int, world_size: int) -> SaveSteps:
    return SaveSteps(rank, world_size, 0, None, SaveDirLocks([]), None, True, True, None,
                     logging.getLogger("test"))  # fmt: skip


@pytest.mark.parametrize(
    ("rank", "world", "tracked", "said"),
    [
        (0, 2, 4, "rank 1 went away during the commit of checkpoint iteration 4 (Connection "
         "closed by peer [127.0.0.1]:29852); the checkpoint of iteration 4 was committed before"),
        (1, 4, None, "a peer rank went away during the commit of checkpoint iteration 4"),
    ],
)  # fmt: skip
def test_the_peer_lost_line(tmp_path: Path, rank, world, tracked, said) -> None:
    if tracked is not None:
        layout.write_tracker_atomic(str(tmp_path), tracked)
    pending = PendingSave(4, str(tmp_path), str(tmp_path / "x"), False, None, 0.0)
    with pytest.raises(PeerLostError) as lost, _steps(rank, world).peer_loss(pending, "commit"):
        raise RuntimeError(GLOO)
    assert str(lost.value).startswith(said) and "\n" not in str(lost.value)
    if tracked is None:
        assert "no checkpoint had been committed there yet" in str(lost.value)
    with pytest.raises(ValueError), _steps(rank, world).peer_loss(pending, "commit"):
        raise ValueError("not a collective's failure")  # anything else passes through
