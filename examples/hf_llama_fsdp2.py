"""A Hugging Face ``LlamaForCausalLM`` under FSDP2, trained through stalwart's guarded step.

Not the bundled GPT: transformers' own Llama (random init from a small config, nothing is
downloaded), sharded with ``fully_shard`` per decoder layer, in a hand-written loop on
``stalwart.loop.Shell``: the README's "in your own loop", call for call. What it gets:

* the rerun state machine: a fault in an iteration is replayed on the same micro-batches and
  RNG before any weight moves; a persistent one exits 16 with a checkpoint, and the relaunch on
  another device reruns that iteration there and exits 17 with the diagnosis;
* the graceful exit: SIGTERM (or ``--exit-interval`` ...) saves a checkpoint, then exits 0; the
  resumed run is bitwise the uninterrupted one (every RNG and the data position are saved);
* DCP checkpoints: sharded on save, loadable on any world size (``tests/integrations/
  test_hf_llama_fsdp2.py`` loads a 2-rank checkpoint into one unsharded model);
* hang detection: the per-rank monitor kills a rank stuck in a step and writes why.

Run it on 2 CPU ranks (gloo; ``pip install 'stalwart[hf]'``)::

    torchrun --nproc-per-node 2 examples/hf_llama_fsdp2.py --save runs/llama --iters 20

``--sigterm-at N`` sends SIGTERM to rank 0 during iteration N (what a scheduler does before a
preemption); ``--fault-at N`` injects a persistent error into iteration N (exit 16; rerun with
``STALWART_DEVICE_ID=other`` to get 17); ``--hang-at N`` makes the last rank hang there.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from stalwart.checkpoint import CheckpointManager
from stalwart.loop import ShellConfig
from stalwart.reliability.exit import ExitConfig
from stalwart.reliability.hang.sections import FaultToleranceConfig, SectionTimeouts
from stalwart.reliability.rerun import RerunConfig, RerunDataIterator

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 128, 16, 2, 2


def llama_config() -> LlamaConfig:
    """A 2-layer Llama with grouped-query attention and attention dropout (the replay and the
    resume must restore the RNG)."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.1, attn_implementation="sdpa",
    )  # fmt: skip


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return LlamaForCausalLM(llama_config())


def shard(model: LlamaForCausalLM) -> nn.Module:
    """FSDP2: every decoder layer its own unit, then the root (embeddings, norm, head)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def batches(rank: int, seed: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches of this rank: a function of (rank, index) only, so a resumed run
    (which skips the consumed ones) reads exactly what the uninterrupted one read."""
    index = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        yield {"input_ids": ids, "labels": ids}
        index += 1


def forward_step(batch: dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


@dataclass
class Job:
    """One launch of the training script (a relaunch builds a fresh one)."""

    save_dir: str
    iters: int
    rank: int = 0
    world_size: int = 1
    fault_at: int | None = None  # 1-based iteration for a persistent injected error
    sigterm_at: int | None = None
    hang_at: int | None = None
    hang_timeout_s: float = 0.0  # > 0: hang detection with this step timeout


def run(job: Job) -> tuple[int, nn.Module]:
    """Train (resuming from ``job.save_dir`` when it holds a checkpoint); the exit code and the
    model. The loop is the README's, plus FSDP2, SIGTERM and the hang monitor."""
    os.makedirs(job.save_dir, exist_ok=True)
    rerun_flags: dict[str, Any] = {}
    if job.fault_at is not None:
        rerun_flags = dict(
            error_injection_rate=1, error_injection_type="persistent_error",
            error_injection_iterations=[job.fault_at],
            result_rejected_tracker_filename=os.path.join(job.save_dir, "rejected.txt"),
        )  # fmt: skip
    model = shard(build_model()) if job.world_size > 1 else build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ft = FaultToleranceConfig(
        enable_ft=job.hang_timeout_s > 0, ft_num_warmup_iters=0, poll_interval_s=0.1,
        timeouts=SectionTimeouts(setup=120, step=job.hang_timeout_s or 180, out_of_section=120),
    )  # fmt: skip
    config = ShellConfig(
        train_iters=job.iters,
        save_dir=job.save_dir,
        ft=ft,
        exit=ExitConfig(save_interval=1000),  # the SIGTERM handler is on unless turned off
        rerun=RerunConfig(**rerun_flags),
    )
    global_batch = MICRO_BATCH * MICROBATCHES * job.world_size
    with config.build(rank=job.rank, world_size=job.world_size) as shell:
        data = RerunDataIterator(batches(job.rank))
        step = shell.step(
            model,
            optimizer,
            forward_step,
            data,
            num_microbatches=MICROBATCHES,
            clip_grad=1.0,
            lookahead=False,
        )
        ckpt = shell.checkpointer(CheckpointManager(job.save_dir), model, optimizer, data=data)
        try:
            shell.start(ckpt)  # resume, if there is a checkpoint
            while True:
                _scheduler_and_hardware_events(job, shell.completed + 1)
                shell.maybe_finalize(ckpt)
                with shell.iteration() as it:
                    if job.hang_at == it.number and job.rank == job.world_size - 1:
                        _stuck_in_the_step()
                    result = step.run(it)
                shell.record(result, batch_size=global_batch)
                code = shell.act(shell.decide(result), ckpt)  # e.g. before an exit 16, SIGTERM
                if code is not None:
                    return code, model
        finally:
            ckpt.close()


def _scheduler_and_hardware_events(job: Job, iteration: int) -> None:
    if job.sigterm_at == iteration and job.rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises a flag; the ranks agree


def _stuck_in_the_step() -> None:
    time.sleep(600)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (collective under FSDP2)."""
    out = {}
    for name, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        out[name] = (full() if callable(full) else value).detach().clone()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fault-at", type=int)
    parser.add_argument("--sigterm-at", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-timeout", type=float, default=0.0)
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        job = Job(args.save, args.iters, int(os.environ.get("RANK", "0")), world_size,
                  args.fault_at, args.sigterm_at, args.hang_at, args.hang_timeout)  # fmt: skip
        return run(job)[0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
