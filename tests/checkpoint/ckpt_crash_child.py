"""Child process for the SIGKILL tests: saves iteration 1, then dies inside the save of iteration 2.

Usage: python ckpt_crash_child.py <save_dir> <sync|async>. It prints READY once iteration 1 is
committed, just before the slow save of iteration 2; the parent kills it once that save's
shards are on disk (the commit then sleeps, see STALWART_TEST_CKPT_SLEEP_S).
"""

from __future__ import annotations

import os
import sys

import torch
from ckpt_fixtures import make_model, make_optimizer, snapshot, train_steps

from stalwart.checkpoint import CheckpointManager
from stalwart.checkpoint.manager import TEST_SLEEP_ENV


def main() -> None:
    save_dir, mode = sys.argv[1], sys.argv[2]
    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    mgr = CheckpointManager(save_dir, async_save=mode == "async")
    mgr.save(1, model, opt, {"iteration": 1}, {"rank": 0})
    mgr.finalize()
    torch.save(snapshot(model, opt), os.path.join(save_dir, "expected_1.pt"))
    train_steps(model, opt, 1, seed=3)
    os.environ[TEST_SLEEP_ENV] = "60"  # test-only: hang inside the commit window
    print("READY", flush=True)
    mgr.save(2, model, opt, {"iteration": 2}, {"rank": 0})
    mgr.finalize()  # async: the commit (and its sleep) happens here
    print("UNREACHABLE", flush=True)


if __name__ == "__main__":
    main()
