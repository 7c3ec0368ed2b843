"""End-to-end: the training log writes the same keys to TensorBoard event files and a W&B run."""

from __future__ import annotations

import glob
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from stalwart.observability.sinks import FanOutSink, MetricSink, TensorBoardSink
from stalwart.observability.timer_names import FORWARD_BACKWARD, INTERVAL_TIME
from stalwart.observability.timers import Timers, TimingLogOption
from stalwart.observability.train_log import LogConfig, TrainingLog

# Megatron's key names and units, grouped by a "<group>/" prefix with --group-metric-tags (one
# TensorBoard section each); the default is Megatron's flat names (the leaf).
GROUPED_KEYS = {
    "optimizer/learning-rate",
    "batch/batch-size",
    "batch/world-size",
    "loss/lm loss",
    "optimizer/loss-scale",
    "optimizer/grad-norm",
    "optimizer/params-norm",
    "loss/lm loss validation",
    "loss/lm loss validation ppl",
}
GROUPED_KEYS |= {f"{k} vs samples" for k in GROUPED_KEYS}
GROUPED_KEYS |= {"throughput/iteration-time", "timers/forward-backward-time"}
EXPECTED_KEYS = {key.split("/", 1)[1] for key in GROUPED_KEYS}
EXPECTED_GROUPS = {"optimizer", "batch", "loss", "throughput", "timers"}


def _drive(sink: MetricSink) -> None:
    timers = Timers(1, TimingLogOption.MAX)
    config = LogConfig(
        log_interval=2,
        log_timers_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True,
        log_world_size_to_tensorboard=True,
        log_progress_bar=False,
    )
    log = TrainingLog(
        config,
        train_iters=4,
        sink=sink,
        timers=timers,
        rank=0,
        world_size=1,
        print_fn=lambda s: None,
    )
    timers(INTERVAL_TIME).start()
    for it in range(1, 5):
        fb = timers(FORWARD_BACKWARD)
        fb.start()
        time.sleep(0.002)
        fb.stop()
        log.on_iteration(
            it,
            losses={"lm loss": torch.tensor(10.0 - it)},
            learning_rate=0.01 * it,
            global_batch_size=4,
            consumed_samples=4 * it,
            grad_norm=torch.tensor(1.0),
            skipped=False,
            loss_scale=1.0,
            params_norm=torch.tensor(3.0),
        )
    log.on_eval(4, {"lm loss": 5.0})
    log.close()
    sink.close()


def _tensorboard_scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_history_keys(wandb_dir: str) -> set[str]:
    """Keys of every history row in an offline run's ``.wandb`` file (LevelDB-log framing)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "*.wandb"))
    data = Path(path).read_bytes()
    block, pos, buf, keys = 32768, 7, b"", set()  # 7-byte ":W&B" file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    return {k for k in keys if not k.startswith("_")} - {"iteration", "samples"}


def test_tensorboard_event_files_have_grouped_keys_on_request(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    _drive(TensorBoardSink(str(tmp_path / "tb"), grouped=True))
    scalars = _tensorboard_scalars(str(tmp_path / "tb"))
    assert set(scalars) == GROUPED_KEYS
    assert {tag.split("/")[0] for tag in scalars} == EXPECTED_GROUPS
    assert scalars["loss/lm loss"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
    assert scalars["loss/lm loss vs samples"] == {4: 9.0, 8: 8.0, 12: 7.0, 16: 6.0}
    # Megatron's unit is seconds: not on the first (start-up) log line.
    assert set(scalars["throughput/iteration-time"]) == {2, 4}
    assert all(0.0 < v < 5.0 for v in scalars["throughput/iteration-time"].values())
    # 2 ms of sleep per iteration, written in seconds (a millisecond value would be >= 2).
    fb = scalars["timers/forward-backward-time"]
    assert set(fb) == {1, 2, 4} and all(0.0015 < v < 1.0 for v in fb.values())
    assert scalars["batch/world-size"][1] == 1.0
    assert scalars["loss/lm loss validation"] == {4: 5.0}


def test_flat_megatron_tags_by_default(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    _drive(TensorBoardSink(str(tmp_path / "tb")))
    scalars = _tensorboard_scalars(str(tmp_path / "tb"))
    assert set(scalars) == EXPECTED_KEYS
    assert scalars["lm loss"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
    assert set(scalars["iteration-time"]) == {2, 4}


def test_wandb_offline_gets_the_same_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import wandb
    except Exception as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"wandb cannot be imported: {exc}")
    from stalwart.observability.sinks import WandbSink

    # wandb keeps process-wide settings from an earlier init in this worker (the probe parity
    # test's disabled run): start from none, as a fresh process does.
    wandb.teardown()

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tb = TensorBoardSink(str(tmp_path / "tb"))
    wb = WandbSink("stalwart-test", "keys", save_dir=str(tmp_path), config={"x": 1})
    _drive(FanOutSink([tb, wb]))
    tb_keys = set(_tensorboard_scalars(str(tmp_path / "tb")))
    # wandb's service process writes the offline file behind the run: on a loaded machine its
    # last records can land a little after finish(), so read until they are all there (or 30 s).
    deadline = time.monotonic() + 30.0
    wb_keys = _wandb_history_keys(str(tmp_path))
    while wb_keys != tb_keys and time.monotonic() < deadline:
        time.sleep(0.5)
        wb_keys = _wandb_history_keys(str(tmp_path))
    assert wb_keys == tb_keys == EXPECTED_KEYS


def test_wandb_run_continues_across_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's id file keeps one W&B run across restarts; without it each start is new."""
    try:
        import wandb  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"wandb cannot be imported: {exc}")
    from stalwart.observability.sinks import WandbMode, WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    id_file = tmp_path / "run" / "wandb_run_id.txt"
    ids = []
    for _ in range(2):  # a first start and a restart
        sink = WandbSink(
            "p", save_dir=str(tmp_path), mode=WandbMode.OFFLINE, resume_file=str(id_file)
        )
        ids.append(sink._run.id)
        sink.close()
    assert ids[0] == ids[1] == id_file.read_text().strip()
    other = WandbSink("p", save_dir=str(tmp_path), mode=WandbMode.OFFLINE)
    assert other._run.id != ids[0]
    other.close()
