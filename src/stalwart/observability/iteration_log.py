"""Every iteration in the run's files and dashboards, with no host read per iteration.

The training log (`stalwart.observability.train_log`) hands each completed iteration's values
to :class:`IterationLog`, which keeps them in an `IterationRing` (device scalars written into a
static tensor; host values beside it). At each log step the ring is copied to the host with
that step's one read, and each iteration becomes:

* one line of ``<metrics stem>.iterations.jsonl`` beside the metrics file
  (`stalwart.observability.run_dir.iterations_path`; ``runs/demo/metrics.iterations.jsonl``)::

      {"iteration": 7, "consumed_samples": 56, "tokens": 7168, "wall_time": 1765152000.12,
       "loss": 2.31, "lm loss": 2.31, "lr": 0.0003, "grad_norm": 0.84, "loss_scale": 1.0,
       "skipped": false, "nan": false}

  ``loss`` is the main loss (``lm loss``, else the first), every loss also under its own key;
  ``tokens`` only when the sequence length is known; on a CUDA device ``iteration_ms``, the
  device time since the previous iteration's end (a CUDA event per iteration, read at the log
  step); ``wall_time`` is the host's clock
  (``time.time()``) when the iteration was recorded: the host may run ahead of the device by
  the queued work, so it is exact only at log steps (which wait for the device); ``skipped``:
  no optimizer step; ``nan``: a non-finite loss. A value the iteration did not have is left out.
* Megatron's per-iteration dashboard keys (``lm loss``, ``learning-rate``, ``grad-norm``, ...
  and their ``vs samples`` twins) at every ``--tensorboard-log-interval``-th iteration, written
  at the log step that read them, in its one transfer (so TensorBoard and W&B have one row per iteration at the
  default interval of 1, with no read per iteration).

The log-interval records of ``metrics.jsonl`` are unchanged (their names are Megatron's API).
Off (``--no-log-every-iteration``; ``LogConfig(log_every_iteration=False)`` on every other
path), or on a rank that writes nothing, or with neither a metrics file nor a dashboard, the
ring is a `NullIterationRing` and the sinks' per-iteration keys are read at their own steps as
before (one read each).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from stalwart.observability.iteration_ring import IterationRing, NullIterationRing, Ring
from stalwart.observability.log_config import LogConfig
from stalwart.observability.run_dir import iterations_path
from stalwart.observability.sinks import JsonlSink, MetricSink

__all__ = ["IterationLog", "iteration_scalars"]

# The ring's names of the loss values ("cur:lm loss"), as the training log's read names them.
_LOSS_PREFIX = "cur:"
# Per-iteration values besides the losses, under the metrics file's names.
_VALUES = ("lr", "grad_norm", "loss_scale", "num_zeros", "params_norm")


class IterationLog:
    """The per-iteration rows of one training log (see the module docstring).

    Args:
        config: the log's settings (``log_every_iteration``, ``tensorboard_log_interval``).
        writer: this rank writes (rank 0); other ranks keep nothing.
        sink: the dashboards (a `NullSink` when none).
        sink_active: ``sink`` writes somewhere.
        metrics_file: the metrics JSONL; the rows go to `iterations_path` of it.
        seq_length: tokens per sample, for the rows' ``tokens``.
        world_size: for ``world-size`` (``log_world_size_to_tensorboard``).
    """

    def __init__(
        self,
        config: LogConfig,
        *,
        writer: bool,
        sink: MetricSink,
        sink_active: bool,
        metrics_file: str | None,
        seq_length: int | None,
        world_size: int,
    ) -> None:
        self.config = config
        self.sink = sink
        self.seq_length = seq_length
        self.world_size = world_size
        wanted = writer and config.log_every_iteration and (bool(metrics_file) or sink_active)
        self.ring: Ring = IterationRing(config.log_interval) if wanted else NullIterationRing()
        self.enabled = wanted
        self._rows: list[dict[str, Any]] = []  # read, not yet written
        self._sink_active = sink_active and wanted
        self._file = (
            JsonlSink(str(iterations_path(metrics_file))) if wanted and metrics_file else None
        )

    # ------------------------------------------------------------------ every iteration
    def keep(
        self,
        iteration: int,
        values: Mapping[str, Any],
        *,
        consumed_samples: int,
        global_batch_size: int,
    ) -> None:
        """``iteration``'s values (tensors stay on the device; see `IterationRing.write`)."""
        if not self.enabled:
            return
        host = {
            "consumed_samples": consumed_samples,
            "global_batch_size": global_batch_size,
            "wall_time": time.time(),  # the host's clock: no read of the device
        }
        self.ring.write(iteration, values, host)

    # ------------------------------------------------------------------ the log step
    def to_read(self) -> torch.Tensor | None:
        """The kept device values, for the log step's one transfer (`IterationRing.to_read`)."""
        return self.ring.to_read()

    def took(self, read: Sequence[float]) -> None:
        """The log step read the values of :meth:`to_read` (as host floats): the kept
        iterations become host rows, written by :meth:`emit`."""
        self._rows = self.ring.rows(read)

    def emit(self) -> int:
        """Every iteration read at this log step to the file and the dashboards (in order).
        Returns the number of rows."""
        rows, self._rows = self._rows, []
        tb_interval = self.config.tensorboard_log_interval
        for row in rows:
            if self._sink_active and row["iteration"] % tb_interval == 0:
                self._write_scalars(row)
        if self._file is not None and rows:
            self._file.write_records(self._record(row) for row in rows)  # one flush
        return len(rows)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _write_scalars(self, row: Mapping[str, Any]) -> None:
        keys = [k.removeprefix(_LOSS_PREFIX) for k in row if k.startswith(_LOSS_PREFIX)]
        scalars = iteration_scalars(
            self.config, row, row["global_batch_size"], keys, self.world_size
        )
        self.sink.add_scalars(scalars, row["iteration"])
        self.sink.add_scalars(
            {f"{k} vs samples": v for k, v in scalars.items()}, row["consumed_samples"]
        )

    def _record(self, row: Mapping[str, Any]) -> dict[str, Any]:
        losses = {
            k.removeprefix(_LOSS_PREFIX): float(v)
            for k, v in row.items()
            if k.startswith(_LOSS_PREFIX)
        }
        main = losses.get("lm loss", next(iter(losses.values()), None))
        samples = row["consumed_samples"]
        record: dict[str, Any] = {"iteration": row["iteration"], "consumed_samples": samples}
        if self.seq_length:
            record["tokens"] = samples * self.seq_length
        record["wall_time"] = row["wall_time"]
        if main is not None:
            record["loss"] = main
        record.update(losses)
        record.update({k: float(row[k]) for k in _VALUES if row.get(k) is not None})
        if "iteration_ms" in row:
            record["iteration_ms"] = row["iteration_ms"]
        record["skipped"] = bool(row.get("skipped", False))
        record["nan"] = any(not math.isfinite(v) for v in losses.values())
        return record


def iteration_scalars(
    config: LogConfig,
    values: Mapping[str, Any],
    global_batch_size: int,
    loss_keys: Iterable[str],
    world_size: int,
) -> dict[str, float]:
    """Megatron's per-iteration dashboard keys from one iteration's host ``values`` (the
    training log's read names: ``lr``, ``grad_norm``, ``cur:<loss>``, ...); None values left
    out."""
    candidates: dict[str, float | None] = {"learning-rate": _float(values.get("lr"))}
    candidates["batch-size"] = float(global_batch_size)
    if config.log_world_size_to_tensorboard:
        candidates["world-size"] = float(world_size)
    candidates.update({key: _float(values.get(f"{_LOSS_PREFIX}{key}")) for key in loss_keys})
    if config.log_loss_scale_to_tensorboard:
        # Without fp16 the scale is 1.0, and Megatron writes it (its optimizers report 1.0).
        scale = _float(values.get("loss_scale"))
        candidates["loss-scale"] = 1.0 if scale is None else scale
    for key in ("grad-norm", "num-zeros", "params-norm"):
        candidates[key] = _float(values.get(key.replace("-", "_")))
    return {k: v for k, v in candidates.items() if v is not None}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
