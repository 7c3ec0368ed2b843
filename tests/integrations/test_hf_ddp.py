"""The Hugging Face ``Trainer`` with ``StalwartTrainer`` on 2 gloo ranks (accelerate's DDP): a
persistent NaN on rank 1 only is blamed on rank 1 alone (exit 17 in the same launch after the
peer replay, ``suspect_devices.json`` names rank 1's device only), the verdict names the
``checkpoint-N`` it saved, and a launch with that device replaced trains on to the end."""

from __future__ import annotations

import json
import os
import queue
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch.multiprocessing as mp

from dist_utils import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _nan_on_rank_1(rank: int, out: str) -> dict[str, Any]:
    import test_hf_trainer as t
    import transformers

    from stalwart.integrations.hf import StalwartCallback, StalwartTrainer, latest_checkpoint
    from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig

    def train(device: str, **rerun: Any) -> Any:
        os.environ[DEVICE_ID_ENV] = device
        callback = StalwartCallback(rerun=RerunConfig(**rerun))
        args = transformers.TrainingArguments(
            out, max_steps=t.STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
            save_strategy="no", report_to=[], use_cpu=True, seed=3, logging_strategy="no",
            disable_tqdm=True, ddp_backend="gloo",
        )  # fmt: skip
        trainer = StalwartTrainer(
            model=t._model(), args=args, train_dataset=t.Tokens(), callbacks=[callback]
        )
        trainer.train(resume_from_checkpoint=latest_checkpoint(out))
        return callback.exit_code, trainer.state.global_step

    try:  # a bad device behind rank 1: its NaN reproduces wherever rank 1 runs it
        train(f"dev{rank}", error_injection_rate=1, error_injection_type="persistent_error",
              error_injection_iterations=[3], error_injection_ranks=[1])  # fmt: skip
        first: Any = None
    except SystemExit as exc:
        first = exc.code
    return {"first": first, "after": train(("dev0", "dev3")[rank])}  # rank 1 on dev3 now


def _worker(rank: int, port: int, out: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        results.put((rank, "ok", _nan_on_rank_1(rank, out)))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def test_ddp_persistent_nan_on_rank_1_is_blamed_on_rank_1_alone(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    out = tmp_path / "out"
    procs = [ctx.Process(target=_worker, args=(r, port, str(out), results)) for r in range(2)]
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
    assert got[0]["first"] == got[1]["first"] == 17, got  # diagnosed in the same launch
    suspects = json.loads((out / "suspect_devices.json").read_text())
    assert [(s["rank"], s["device"]) for s in suspects["suspects"]] == [(1, "dev1")]
    verdict = json.loads((out / "rerun_verdict.json").read_text())
    assert (out / verdict["checkpoint"] / "stalwart_state_rank1.pt").is_file(), verdict
    assert got[0]["after"] == got[1]["after"] == (0, 5), got  # dev1 replaced: trains on
