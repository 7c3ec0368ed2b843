"""Lightning DDP on 2 gloo ranks with stalwart's callback: SIGTERM on rank 0 only is agreed by
both ranks (one save through Lightning, exit 0 on both), and the resume is bitwise the
uninterrupted run on every rank (each rank's RNG is in the checkpoint)."""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import torch.multiprocessing as mp

from dist_utils import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _worker(rank: int, port: int, tmp: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", NODE_RANK="0",
        TORCHELASTIC_RUN_ID="stalwart-test", OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        import lightning.pytorch as L
        import test_lightning as t
        import torch

        def fit(save: Path, *extra: Any) -> tuple[Any, Any]:
            callback = t.StalwartCallback(str(save))
            trainer = L.Trainer(
                max_steps=t.STEPS, accelerator="cpu", devices=2, strategy="ddp",
                callbacks=[callback, *extra], enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            module = t.TinyLlama()
            ckpt = t.latest_checkpoint(str(save))
            trainer.fit(module, t._loader(), ckpt_path=ckpt, weights_only=True)
            return module, callback

        tmp_path = Path(tmp)
        full, _ = fit(tmp_path / "full")
        _, stopped = fit(tmp_path / "sig", *([t.SigtermAt(3)] if rank == 0 else []))
        resumed, callback = fit(tmp_path / "sig")
        same = all(
            torch.equal(a, b)
            for a, b in zip(t._params(full).values(), t._params(resumed).values(), strict=True)
        )
        results.put((rank, "ok", (stopped.exit_code, callback.exit_code, same)))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def test_ddp_sigterm_on_one_rank_saves_once_and_resumes_bitwise(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            rank, status, value = results.get(timeout=170)
            assert status == "ok", f"rank {rank}: {value}"
            got[rank] = value
    except queue.Empty:
        pytest.fail("the ranks did not report within 170 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: (0, 0, True), 1: (0, 0, True)}
    assert (tmp_path / "sig" / "iter_0000003.ckpt").is_file()
