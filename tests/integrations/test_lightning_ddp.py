"""Lightning DDP on 2 gloo ranks with stalwart's callback, as the README's recipe writes it (a
``ResumableLoader`` passed to ``trainer.fit``):

* each rank trains on its own shard (disjoint samples, a new order every epoch, as Lightning's
  ``DistributedSampler``); SIGTERM on rank 0 only is agreed by both ranks (one save through
  Lightning, exit 0 on both) and the mid-epoch resume is bitwise the uninterrupted run on every
  rank, on the same samples;
* a persistent NaN on rank 1 only is blamed on rank 1 alone (checked in DDP's comm hook before
  the all-reduce, replayed on rank 0): exit 17 in the same launch, ``suspect_devices.json``
  names rank 1's device only, and a launch with that device replaced trains on to the end.
"""

from __future__ import annotations

import json
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

ROWS = 24  # 3 batches of 4 per rank and epoch: 5 steps cross an epoch boundary


def _loader() -> Any:
    """The user's loader: shuffled, with each sample's index to see who trained on what."""
    import torch
    from test_lightning import SEQ, VOCAB

    from stalwart.integrations.resumable import ResumableLoader

    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row, "index": i} for i, row in enumerate(ids)]
    return ResumableLoader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))


def _shard_and_resume(rank: int, tmp_path: Path) -> dict[str, Any]:
    import lightning.pytorch as L
    import test_lightning as t
    import torch

    class Seen(L.Callback):
        def __init__(self) -> None:
            self.indices: list[int] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            self.indices += batch["index"].tolist()

    def fit(save: Path, *extra: Any) -> tuple[Any, Any, list[int]]:
        seen = Seen()
        callback = t.StalwartCallback(str(save))
        trainer = L.Trainer(
            max_steps=t.STEPS, accelerator="cpu", devices=2, strategy="ddp",
            callbacks=[callback, seen, *extra], enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(save),
        )  # fmt: skip
        module = t.TinyLlama()
        trainer.fit(module, _loader(), ckpt_path=t.latest_checkpoint(str(save)),
                    weights_only=True)  # fmt: skip
        return module, callback, seen.indices

    full, _, seen_full = fit(tmp_path / "full")
    _, stopped, seen_before = fit(tmp_path / "sig", *([t.SigtermAt(2)] if rank == 0 else []))
    resumed, callback, seen_after = fit(tmp_path / "sig")
    same = all(
        torch.equal(a, b)
        for a, b in zip(t._params(full).values(), t._params(resumed).values(), strict=True)
    )

    class OwnLoader(t.TinyLlama):  # Lightning builds it after the callback could shard it
        def train_dataloader(self) -> Any:
            return _loader()

    trainer = L.Trainer(
        max_steps=t.STEPS,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[t.StalwartCallback(str(tmp_path / "own"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(OwnLoader())
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {
        "codes": (stopped.exit_code, callback.exit_code), "same": same, "seen": seen_full,
        "seen_resumed": seen_before[: 2 * 4] + seen_after, "refused": refused,
    }  # fmt: skip


def _fault_on_rank_1(rank: int, tmp_path: Path, at: int, peer: bool) -> dict[str, Any]:
    """A bad device behind rank 1 (its NaN reproduces wherever rank 1 runs it) at iteration
    ``at``: with the peer replay, exit 17 in the same launch; without, exit 16, then 17 from the
    relaunch on other devices. Then a launch with rank 1's device replaced trains on; its final
    weights against the fault-free run's."""
    import lightning.pytorch as L
    import test_lightning as t
    import torch

    from stalwart.reliability.rerun import DEVICE_ID_ENV, RerunConfig

    def fit(save: Path, device: str, **rerun: Any) -> Any:
        os.environ[DEVICE_ID_ENV] = device
        callback = t.StalwartCallback(str(save), rerun=RerunConfig(**rerun))
        trainer = L.Trainer(
            max_steps=t.STEPS, accelerator="cpu", devices=2, strategy="ddp",
            callbacks=[callback], enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module = t.TinyLlama()
        try:
            trainer.fit(
                module, _loader(), ckpt_path=t.latest_checkpoint(str(save)), weights_only=True
            )
        except SystemExit as exc:
            return exc.code, None, None
        return callback.exit_code, trainer.global_step, t._params(module)

    _, _, reference = fit(tmp_path / "reference", f"dev{rank}")
    save = tmp_path / "out"
    fault = dict(
        error_injection_rate=1,
        error_injection_type="persistent_error",
        error_injection_iterations=[at],
        error_injection_ranks=[1],
        rerun_peer_replay=peer,
    )
    elsewhere = ("dev0", "dev3")[rank]  # rank 1 on dev3 now
    codes = [fit(save, f"dev{rank}", **fault)[0]]
    if not peer:  # the relaunch after 16 reruns the iteration elsewhere: the diagnosis, 17
        codes.append(fit(save, elsewhere, **fault)[0])
    code, steps, params = fit(save, elsewhere)
    same = all(torch.equal(a, b) for a, b in zip(reference.values(), params.values(), strict=True))
    return {"codes": codes, "after": (code, steps), "same": same}


def _worker(scenario: str, rank: int, port: int, tmp: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0",
        NODE_RANK="0",
        TORCHELASTIC_RUN_ID="stalwart-test",
        OMP_NUM_THREADS="1",
    )
    try:
        if scenario == "shard":
            got = _shard_and_resume(rank, Path(tmp))
        else:  # "17": the peer replay's verdict at an epoch's first batch; "16": Megatron's
            got = _fault_on_rank_1(
                rank, Path(tmp), *((4, True) if scenario == "17" else (3, False))
            )
        results.put((rank, "ok", got))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def _run(scenario: str, tmp_path: Path) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(scenario, r, port, str(tmp_path), results))
        for r in range(2)
    ]
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
    return got


def test_ddp_shards_sigterm_on_one_rank_saves_once_and_resumes_bitwise(tmp_path: Path) -> None:
    got = _run("shard", tmp_path)
    for rank in (0, 1):
        assert got[rank]["codes"] == (0, 0) and got[rank]["same"], (rank, got[rank])
        assert got[rank]["seen_resumed"] == got[rank]["seen"], rank  # the same samples
    per_epoch = ROWS // 2
    first = [got[r]["seen"][:per_epoch] for r in (0, 1)]
    assert sorted(first[0] + first[1]) == list(range(ROWS))  # epoch 0: disjoint, all of it
    second = got[0]["seen"][per_epoch:]
    assert second and second != first[0][: len(second)]  # set_epoch: a new order
    assert (tmp_path / "sig" / "iter_0000002.ckpt").is_file()
    for rank in (0, 1):  # a loader the callback cannot reach in time: refused in one line
        refused = got[rank]["refused"]
        assert refused.startswith("ResumableLoader under 2 ranks: its DataLoader has no "
                                  "DistributedSampler") and "\n" not in refused, refused  # fmt: skip


def test_ddp_persistent_nan_on_rank_1_is_blamed_on_rank_1_alone(tmp_path: Path) -> None:
    """Exit 17 in the launch (peer replay), at the first batch of the second epoch; the launch
    on other devices resumes at that batch and ends bitwise equal to the run without a fault."""
    got = _run("17", tmp_path)
    assert got[0]["codes"] == got[1]["codes"] == [17], got  # diagnosed in the same launch
    suspects = json.loads((tmp_path / "out" / "suspect_devices.json").read_text())
    assert [(s["rank"], s["device"]) for s in suspects["suspects"]] == [(1, "dev1")]
    verdict = json.loads((tmp_path / "out" / "rerun_verdict.json").read_text())
    assert verdict["checkpoint"] == "iter_0000003.ckpt", verdict  # the completed iterations
    assert (tmp_path / "out" / verdict["checkpoint"]).is_file(), verdict
    assert got[0]["after"] == got[1]["after"] == (0, 5), got  # dev1 replaced: trains on
    assert got[0]["same"] and got[1]["same"], got  # bitwise the run without the fault


def test_ddp_exit_16_then_17_elsewhere_then_trains_on_bitwise(tmp_path: Path) -> None:
    """Megatron's way (no peer replay): exit 16 with a checkpoint, the relaunch on other
    devices reruns the iteration there (17: persistent on rank 1's device), a launch without
    that device trains on from the checkpoint, bitwise as the run without the fault."""
    got = _run("16", tmp_path)
    assert got[0]["codes"] == got[1]["codes"] == [16, 17], got
    assert got[0]["after"] == got[1]["after"] == (0, 5), got
    assert got[0]["same"] and got[1]["same"], got
