"""The Hugging Face ``Trainer`` with ``StalwartTrainer`` on 2 gloo ranks (accelerate's DDP): a
persistent NaN on rank 1 only is blamed on rank 1 alone (exit 17 in the same launch after the
peer replay, ``suspect_devices.json`` names rank 1's device only; or Megatron's exit 16, then
17 from the relaunch elsewhere), the verdict names the ``checkpoint-N`` it saved, and a launch
with that device replaced trains on to the end, bitwise equal to the run without the fault."""

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


def _fault_on_rank_1(rank: int, out: str, peer: bool) -> dict[str, Any]:
    """A bad device behind rank 1 (its NaN reproduces wherever rank 1 runs it) at iteration 3:
    with the peer replay, exit 17 in the same launch; without, exit 16, then 17 from the
    relaunch on other devices. Then a launch with rank 1's device replaced trains on; its final
    weights against the fault-free run's."""
    import test_hf_trainer as t
    import torch
    import transformers

    from stalwart.integrations.hf import StalwartCallback, StalwartTrainer, latest_checkpoint
    from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig

    def train(where: str, device: str, **rerun: Any) -> Any:
        os.environ[DEVICE_ID_ENV] = device
        callback = StalwartCallback(rerun=RerunConfig(**rerun))
        args = transformers.TrainingArguments(
            where, max_steps=t.STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
            save_strategy="no", report_to=[], use_cpu=True, seed=3, logging_strategy="no",
            disable_tqdm=True, ddp_backend="gloo",
        )  # fmt: skip
        trainer = StalwartTrainer(
            model=t._model(), args=args, train_dataset=t.Tokens(), callbacks=[callback]
        )
        try:
            trainer.train(resume_from_checkpoint=latest_checkpoint(where))
        except SystemExit as exc:
            return exc.code, None, None
        return callback.exit_code, trainer.state.global_step, t._params(trainer)

    _, _, reference = train(out + "-reference", f"dev{rank}")
    fault = dict(
        error_injection_rate=1,
        error_injection_type="persistent_error",
        error_injection_iterations=[3],
        error_injection_ranks=[1],
        rerun_peer_replay=peer,
    )
    elsewhere = ("dev0", "dev3")[rank]  # rank 1 on dev3 now
    codes = [train(out, f"dev{rank}", **fault)[0]]
    if not peer:  # the relaunch after 16 reruns the iteration elsewhere: the diagnosis, 17
        codes.append(train(out, elsewhere, **fault)[0])
    code, steps, params = train(out, elsewhere)
    same = all(torch.equal(a, b) for a, b in zip(reference.values(), params.values(), strict=True))
    return {"codes": codes, "after": (code, steps), "same": same}


def _worker(rank: int, port: int, out: str, peer: bool, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    try:
        results.put((rank, "ok", _fault_on_rank_1(rank, out, peer)))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def _run(tmp_path: Path, peer: bool) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    out = tmp_path / "out"
    procs = [ctx.Process(target=_worker, args=(r, port, str(out), peer, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            rank, status, value = results.get(timeout=300)
            assert status == "ok", f"rank {rank}: {value}"
            got[rank] = value
    except queue.Empty:
        pytest.fail("the ranks did not report within 300 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_ddp_persistent_nan_on_rank_1_is_blamed_on_rank_1_alone(tmp_path: Path) -> None:
    """Exit 17 in the launch (peer replay); the verdict names ``checkpoint-2`` (the completed
    iterations), a launch on other devices trains on from it to the end, bitwise equal to the
    run without the fault (iteration 3's batch and RNG are trained on, not skipped)."""
    got = _run(tmp_path, peer=True)
    out = tmp_path / "out"
    assert got[0]["codes"] == got[1]["codes"] == [17], got  # diagnosed in the same launch
    suspects = json.loads((out / "suspect_devices.json").read_text())
    assert [(s["rank"], s["device"]) for s in suspects["suspects"]] == [(1, "dev1")]
    verdict = json.loads((out / "rerun_verdict.json").read_text())
    assert verdict["checkpoint"] == "checkpoint-2", verdict
    assert (out / verdict["checkpoint"] / "stalwart_state_rank1.pt").is_file(), verdict
    assert got[0]["after"] == got[1]["after"] == (0, 5), got  # dev1 replaced: trains on
    assert got[0]["same"] and got[1]["same"], got


def test_ddp_exit_16_then_17_elsewhere_then_trains_on_bitwise(tmp_path: Path) -> None:
    """Megatron's way (no peer replay): exit 16 with ``checkpoint-2``, the relaunch on other
    devices reruns iteration 3 there (17), a launch without rank 1's device trains on, bitwise
    as the run without the fault."""
    got = _run(tmp_path, peer=False)
    assert got[0]["codes"] == got[1]["codes"] == [16, 17], got
    assert got[0]["after"] == got[1]["after"] == (0, 5), got
    assert got[0]["same"] and got[1]["same"], got
