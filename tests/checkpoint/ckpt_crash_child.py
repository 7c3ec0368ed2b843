"""Child process for the SIGKILL tests: saves iteration 1, then dies inside the save of iteration 2.

Usage: python ckpt_crash_child.py <save_dir> <sync|async>. It prints READY once iteration 1 is
committed, just before the slow save of iteration 2; the parent kills it once that save's
shards are on disk (the commit of iteration 2 then sleeps: the ``before_commit`` hook).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from ckpt_fixtures import make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointManager


def _hang_in_commit_of_2(iteration: int) -> None:
    if iteration == 2:
        time.sleep(60)  # the parent SIGKILLs this process inside the commit window


def main() -> None:
    save_dir, mode = sys.argv[1], sys.argv[2]
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    mgr = CheckpointManager(
        save_dir, async_save=mode == "async", before_commit=_hang_in_commit_of_2
    )
    mgr.save(1, model, opt, {"iteration": 1}, {"rank": 0})
    mgr.finalize()
    torch.save(snapshot(model, opt), os.path.join(save_dir, "expected_1.pt"))
    train_steps(model, opt, 1, seed=3)
    print("READY", flush=True)
    mgr.save(2, model, opt, {"iteration": 2}, {"rank": 0})
    mgr.finalize()  # async: the commit (and its sleep) happens here
    print("UNREACHABLE", flush=True)


if __name__ == "__main__":
    main()
