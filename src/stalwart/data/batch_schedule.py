"""Global batch size per iteration: constant, or ramped up (``--rampup-batch-size``, Megatron's).

``--rampup-batch-size START INCREMENT RAMP_SAMPLES`` starts at ``START`` samples per iteration and
adds ``INCREMENT`` in equal steps over the first ``RAMP_SAMPLES`` consumed samples until
``--global-batch-size`` is reached: with ``n = (global - START) / INCREMENT`` steps, the batch
size after ``c`` consumed samples is ``START + INCREMENT * floor(c / (RAMP_SAMPLES / n))`` (capped
at the global batch size). It is a pure function of the consumed samples, the one number a
checkpoint stores, so a resume anywhere in the ramp continues it exactly. Every size of the ramp
must be a multiple of ``micro-batch size x data-parallel size`` (checked up front).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size and micro-batch count as functions of the consumed samples."""

    global_batch_size: int  # the final (and, without a ramp, the only) size
    micro_batch_size: int
    data_parallel_size: int
    rampup: tuple[int, int, int] | None = None  # (start, increment, ramp samples)

    def __post_init__(self) -> None:
        per_step = self.micro_batch_size * self.data_parallel_size
        if self.rampup is None:
            sizes = [self.global_batch_size]
        else:
            start, increment, ramp_samples = self.rampup
            if start < 1 or increment < 1 or ramp_samples < 0:
                raise ValueError(
                    "--rampup-batch-size START INCREMENT RAMP_SAMPLES: START and INCREMENT must "
                    f"be >= 1 and RAMP_SAMPLES >= 0, got {list(self.rampup)}"
                )
            span = self.global_batch_size - start
            if span <= 0 or span % increment:
                raise ValueError(
                    f"--rampup-batch-size: --global-batch-size ({self.global_batch_size}) minus "
                    f"START ({start}) must be a positive multiple of INCREMENT ({increment})"
                )
            sizes = list(range(start, self.global_batch_size + 1, increment))
        bad = [g for g in sizes if g % per_step]
        if bad:
            raise ValueError(
                f"--rampup-batch-size/--global-batch-size: batch sizes {bad} are not multiples "
                f"of --micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                f"({self.data_parallel_size}) = {per_step}"
            )

    @classmethod
    def from_flags(
        cls,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: Sequence[int] | None,
    ) -> BatchSchedule:
        if rampup_batch_size is not None and len(rampup_batch_size) != 3:
            raise ValueError(
                "--rampup-batch-size takes three integers: START INCREMENT RAMP_SAMPLES, "
                f"got {list(rampup_batch_size)}"
            )
        ramp = None if rampup_batch_size is None else tuple(int(v) for v in rampup_batch_size)
        sizes = (global_batch_size, micro_batch_size, data_parallel_size)
        return cls(*sizes, ramp)  # type: ignore[arg-type]

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Samples the iteration that starts after ``consumed_samples`` consumes."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup
        if consumed_samples >= ramp_samples:
            return self.global_batch_size
        num_steps = (self.global_batch_size - start) // increment
        samples_per_step = ramp_samples / num_steps
        size = start + increment * int(consumed_samples / samples_per_step)
        return min(size, self.global_batch_size)

    def iterations_for_samples(self, train_samples: int) -> int:
        """Iterations until at least ``train_samples`` samples are consumed
        (``--train-samples``)."""
        consumed = iterations = 0
        ramp_end = 0 if self.rampup is None else self.rampup[2]
        while consumed < train_samples and consumed < ramp_end:  # inside the ramp: step by step
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        remaining = max(0, train_samples - consumed)
        return iterations + -(-remaining // self.global_batch_size)  # ceil

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches per rank of that iteration."""
        per_step = self.micro_batch_size * self.data_parallel_size
        return self.global_batch_size_at(consumed_samples) // per_step
