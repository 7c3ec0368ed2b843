"""A Hugging Face ``LlamaForCausalLM`` under FSDP2 on 2 gloo ranks, through the guarded step
(``examples/hf_llama_fsdp2.py``, run as written).

One pair of rank processes runs the "jobs" one after another, each built fresh as a relaunch
would build it: an uninterrupted run; a run stopped by SIGTERM (checkpoint, exit 0) and its
resume, bitwise equal to the uninterrupted one; a persistent injected fault (exit 16 with a
checkpoint) and its relaunch on another device (exit 17, the fault attributed to the first
device); last a hang in one rank's step, which the monitors detect and kill. The test process
then loads the 2-rank DCP checkpoint into one unsharded model (2 -> 1) and trains on from it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.multiprocessing as mp

from stalwart.checkpoint import CheckpointManager
from stalwart.reliability.rerun import DEVICE_ID_ENV

from dist_utils import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama_fsdp2.py"
ITERS, FAULT_AT, SIGTERM_AT, HANG_AT = 4, 3, 2, 2


def _example() -> ModuleType:
    if "hf_llama_fsdp2" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hf_llama_fsdp2", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hf_llama_fsdp2"] = module
        spec.loader.exec_module(module)
    return sys.modules["hf_llama_fsdp2"]


def _jobs(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    ex = _example()
    out: dict[str, Any] = {}
    code, model = ex.run(ex.Job(str(tmp / "full"), ITERS, rank, world))
    out["full"] = (code, ex.full_state(model))
    out["sigterm"] = ex.run(ex.Job(str(tmp / "sig"), ITERS, rank, world, sigterm_at=SIGTERM_AT))[0]
    code, model = ex.run(ex.Job(str(tmp / "sig"), ITERS, rank, world))
    out["resumed"] = (code, ex.full_state(model))
    codes = []
    for device in ("gpu-a", "gpu-b"):
        os.environ[DEVICE_ID_ENV] = device
        codes.append(ex.run(ex.Job(str(tmp / "fault"), ITERS, rank, world, fault_at=FAULT_AT))[0])
    del os.environ[DEVICE_ID_ENV]
    out["fault"] = codes
    return out


def _worker(rank: int, world: int, port: int, tmp: str, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, "ok", _jobs(rank, world, Path(tmp))))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc!r}\n{traceback.format_exc()}"))
        raise
    ex = _example()
    ex.run(ex.Job(str(Path(tmp) / "hang"), ITERS, rank, world, hang_at=HANG_AT, hang_timeout_s=3))
    results.put((rank, "error", "the hang was not detected"))


def _launch(tmp: Path) -> tuple[dict[int, dict[str, Any]], list[int | None]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp), results)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank: dict[int, dict[str, Any]] = {}
    try:
        while len(by_rank) < 2:
            rank, status, value = results.get(timeout=170)
            assert status == "ok", f"rank {rank}: {value}"
            by_rank[rank] = value
        for p in procs:
            p.join(timeout=60)
    except queue.Empty:
        pytest.fail("the ranks did not report within 170 s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return by_rank, [p.exitcode for p in procs]


def test_hf_llama_fsdp2_rerun_sigterm_resume_reshard_and_hang(tmp_path: Path) -> None:
    by_rank, exitcodes = _launch(tmp_path)
    ex = _example()
    for rank, out in by_rank.items():
        assert out["full"][0] == 0 and out["sigterm"] == 0 and out["resumed"][0] == 0, rank
        # SIGTERM saved, and the resumed run is the uninterrupted one, bitwise.
        full, resumed = out["full"][1], out["resumed"][1]
        assert full.keys() == resumed.keys()
        for name in full:
            assert torch.equal(full[name], resumed[name]), name
        assert out["fault"] == [16, 17], rank
    sig = json.loads((tmp_path / "sig" / "exit_reason.json").read_text())
    assert sig["exit_code"] == 0
    assert (tmp_path / "sig" / "latest_checkpointed_iteration.txt").read_text() == f"{ITERS}\n"
    # The fault: exit 16 left a checkpoint of the iteration before; the rerun on gpu-b was
    # clean, so the first device is blamed (17).
    fault = tmp_path / "fault"
    assert (fault / "latest_checkpointed_iteration.txt").read_text() == f"{FAULT_AT - 1}\n"
    assert json.loads((fault / "exit_reason.json").read_text())["exit_code"] == 17
    for rank in (0, 1):  # each rank's line per pass: NaN on gpu-a twice, a clean value on gpu-b
        lines = [
            dict(field.split("=", 1) for field in line.split(" message=")[0].split()[2:])
            for line in (fault / "rejected.txt").read_text().splitlines()
            if f" rank={rank} " in line
        ]
        assert [(x["device"], x["status"]) for x in lines] == [
            ("gpu-a", "initial_run"), ("gpu-a", "first_rerun_reproducible"),
            ("gpu-b", "second_rerun_not_reproducible"),
        ], lines  # fmt: skip
        assert lines[0]["result"] == "nan" and float(lines[2]["result"]) > 0
    # The hang: both ranks killed by their monitors; the hung rank's report names the step.
    assert all(code is not None and code != 0 for code in exitcodes), exitcodes
    report = json.loads((tmp_path / "hang" / "ft_logs" / "ft_hang_rank1.json").read_text())
    assert report["section"] == "step"
    assert "_stuck_in_the_step" in (tmp_path / "hang" / "ft_logs" / "monitor_rank1.log").read_text()
    # 2 -> 1 rank: the sharded checkpoint loads into one unsharded model, equal to the full
    # parameters the 2 ranks gathered, and training goes on from it on one process.
    model = ex.build_model(seed=99)
    CheckpointManager(None, str(tmp_path / "full")).load(model, None, load_optim=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, by_rank[0]["full"][1][name]), name
    code, _ = ex.run(ex.Job(str(tmp_path / "full"), ITERS + 1))
    assert code == 0
    assert (tmp_path / "full" / "latest_checkpointed_iteration.txt").read_text() == f"{ITERS + 1}\n"
