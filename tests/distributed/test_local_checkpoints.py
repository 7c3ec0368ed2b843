"""Local copies and in-memory snapshots on 2 gloo ranks (issue 43): a SIGKILL between
persistent saves resumes from the newest local copy; a lost node's copies come from their
replicas; without replicas the job falls back to the newest complete copy and says which; an
in-process restart resumes from memory without reading a checkpoint file. Every run ends bitwise
equal to the fault-free job (the session's shared 2-rank reference).

Fake nodes: ``STALWART_FAKE_NODE_SIZE=1`` puts each rank on a node of its own, whose local
directory is ``<local>/fake_node_<rank>``.
"""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import record_checkpoint_reads, run_cli_on_ranks, run_distributed
from train_utils import TINY_FLAGS, assert_params_equal, load_params

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The shared reference's job (seed 3, global batch 8, 12 iterations), other save intervals:
# persistent at 6 and 12, non-persistent at 2, 4, 8, 10.
JOB = ["train", *TINY_FLAGS, "--train-iters", "12", "--seed", "3", "--global-batch-size", "8"]
JOB += ["--save-interval", "6", "--non-persistent-save-interval", "2"]
FAKE_NODES = {"STALWART_FAKE_NODE_SIZE": "1", "PYTHONUNBUFFERED": "1"}
KILL = ["--inject-fault", "sigkill", "--inject-fault-rank", "1", "--inject-fault-iteration", "11"]


def _local(root: Path, *extra: str) -> list[str]:
    where = ["--save", str(root / "save"), "--non-persistent-local-ckpt-dir", str(root / "local")]
    return [*JOB, *where, "--non-persistent-ckpt-type", "local", *extra]


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.log[-4000:]
    return proc.log


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job with replicas (2 fake nodes, factor 2), rank 1 SIGKILLed during iteration 11:
    local copies of 8 (complete) and maybe 10 on both nodes, the persistent checkpoint of 6.
    Kept in ``pristine/``: a test puts it back in place (:func:`_fresh`) and relaunches there
    (local copies belong to the job whose --save is at that path)."""
    root = tmp_path_factory.mktemp("killed")
    proc = run_cli_on_ranks(_local(root, "--replication", *KILL), root / "logs", env=FAKE_NODES)
    assert proc.codes[1] == -9, proc.log[-3000:]
    assert (root / "save" / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    for name in ("save", "local"):
        shutil.copytree(root / name, root / "pristine" / name, symlinks=True)
    return root


def _fresh(killed: Path) -> Path:
    """The killed job's directories as the kill left them, in place."""
    for name in ("save", "local"):
        shutil.rmtree(killed / name)
        shutil.copytree(killed / "pristine" / name, killed / name, symlinks=True)
    return killed


def _resumed_local(log: str) -> int:
    match = re.search(r"resumed from the local copy of iteration (\d+) at iteration \1", log)
    assert match, log[-4000:]
    return int(match.group(1))


def test_sigkill_resumes_from_the_newest_local_copy_bitwise(
    killed: Path, tmp_path: Path, two_rank_reference: Path
) -> None:
    job = _fresh(killed)
    log = _ok(run_cli_on_ranks(_local(job, "--replication"), tmp_path / "logs", env=FAKE_NODES))
    assert _resumed_local(log) in (8, 10)  # 10 when its write ended before the kill
    assert "also found the persistent checkpoint of iteration 6" in log
    assert_params_equal(load_params(two_rank_reference), load_params(job / "save"))


def test_a_lost_node_directory_is_covered_by_the_replicas(
    killed: Path, tmp_path: Path, two_rank_reference: Path
) -> None:
    job = _fresh(killed)
    shutil.rmtree(job / "local" / "fake_node_1")  # node 1 is gone, its disk with it
    log = _ok(run_cli_on_ranks(_local(job, "--replication"), tmp_path / "logs", env=FAKE_NODES))
    it = _resumed_local(log)
    assert it in (8, 10)
    assert "rank 1's shard from rank 0's directory" in log, log[-4000:]
    assert_params_equal(load_params(two_rank_reference), load_params(job / "save"))


def test_without_replicas_a_lost_node_falls_back_to_the_newest_complete_copy(
    killed: Path, tmp_path: Path, two_rank_reference: Path
) -> None:
    """What a job without --replication has on disk (rank 0's own shards only), node 1 gone:
    the local copies are incomplete, the persistent checkpoint of 6 is loaded, and the line
    says which and why."""
    job = _fresh(killed)
    shutil.rmtree(job / "local" / "fake_node_1")
    for replica in (job / "local" / "fake_node_0").rglob("shard_00001"):
        shutil.rmtree(replica)
    log = _ok(run_cli_on_ranks(_local(job), tmp_path / "logs", env=FAKE_NODES))
    line = re.search(r"resuming from the persistent checkpoint of iteration 6 \(.*", log)
    assert line, log[-4000:]
    assert re.search(
        r"not the local copy: iteration 1?\d lacks rank 1's shard .*"
        r"--replication is off",
        line.group(0),
    ), line.group(0)
    assert re.search(r"resumed from \S+iter_0000006 at iteration 6", log)
    assert_params_equal(load_params(two_rank_reference), load_params(job / "save"))


def test_in_process_restart_resumes_from_memory_without_reading_a_checkpoint_file(
    tmp_path: Path, two_rank_reference: Path
) -> None:
    save, reads = tmp_path / "save", tmp_path / "reads.txt"
    args = [
        *JOB,
        "--save",
        str(save),
        "--non-persistent-ckpt-type",
        "in_memory",
        "--inprocess-restart",
        "--inject-fault",
        "exception",
        "--inject-fault-rank",
        "1",
        "--inject-fault-iteration",
        "9",
    ]
    audit = functools.partial(record_checkpoint_reads, str(reads), str(save))
    log = _ok(run_cli_on_ranks(args, tmp_path / "logs", env=FAKE_NODES, prelude=audit))
    assert "in-process restart attempt 1: rank 1 failed at iteration 9" in log, log[-4000:]
    assert "resumed from the in-memory snapshot of iteration 8 at iteration 8" in log
    assert "also found the persistent checkpoint of iteration 6" in log
    assert not reads.exists() or reads.read_text() == "", reads.read_text()
    assert_params_equal(load_params(two_rank_reference), load_params(save))
    # The audit sees a resume from disk: the same job again has nothing left to train and
    # loads iteration 12's checkpoint, reading its files.
    _ok(run_cli_on_ranks(args, tmp_path / "logs2", env=FAKE_NODES, prelude=audit))
    assert "iter_0000012/" in reads.read_text()


def _tiny(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_on_two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import os

    from stalwart.checkpoint import dcp_io
    from stalwart.checkpoint.local import LocalCheckpoints
    from stalwart.checkpoint.replication import Replication

    os.environ["STALWART_FAKE_NODE_SIZE"] = "1"
    model, optimizer = _tiny(0)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    local = LocalCheckpoints(root, replication=Replication(jump=1, factor=2))
    local.check_writable()
    local.save(5, dcp_io.gather_state(model, optimizer, for_save=True), {"it": 5}, {"r": rank})
    assert local.maybe_finalize(blocking=True) == 5
    local.close()
    moments = dcp_io.gather_state(model, optimizer)["optim"]["state"]["0.weight"]
    # NumPy copies: a tensor would go back through shared memory that dies with this process.
    tensors = {**moments, **model.state_dict()}
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}


def test_a_two_rank_local_copy_resumes_on_one_rank_from_one_node(tmp_path, monkeypatch) -> None:
    """``fully_parallel`` spreads the replicated state over the 2 ranks; after node 1 is gone, a
    1-rank job (an exclusion) reads rank 1's part from its replica on node 0 (what the fault
    schedule's exclusion does with local copies)."""
    from stalwart.checkpoint import dcp_io
    from stalwart.checkpoint.local import LocalCheckpoints

    saved = run_distributed(_save_on_two_ranks, 2, (str(tmp_path / "local"),))[0]
    shutil.rmtree(tmp_path / "local" / "fake_node_1")
    monkeypatch.setenv("STALWART_FAKE_NODE_SIZE", "1")
    model, optimizer = _tiny(7)
    local = LocalCheckpoints(str(tmp_path / "local"))
    offer = local.plan([local.report()], exclude=set())
    assert offer.iteration == 5 and "rank 1's shard from rank 0's directory" in offer.where
    problem, small = local.load(offer.plan, model, optimizer, strict=True, check_common=None)
    assert problem is None and small == ({"it": 5}, {"r": 0}, 2)
    state = dcp_io.gather_state(model, optimizer)
    for key, value in model.state_dict().items():
        assert torch.equal(value, torch.from_numpy(saved[key])), key
    for key, value in state["optim"]["state"]["0.weight"].items():
        assert torch.equal(value, torch.from_numpy(saved[key])), key
    local.close()
