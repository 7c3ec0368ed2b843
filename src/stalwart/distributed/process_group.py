"""Process-group set-up and tear-down.

Nothing here is global state of stalwart's own: the process group lives in torch.distributed, and
`DistributedContext` is a plain value passed to whoever needs rank/world size/device.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: torch.distributed.nn.functional binds
# ``group=group.WORLD`` as a default argument of its ten collectives, which captures the default
# group alive at its import. torch.distributed.checkpoint imports it (through fsdp); imported
# first at a save, after the group exists, it would hold that group forever, so an in-process
# restart could never free a failed attempt's gloo group and its peers' pending collectives
# would never return (the W16 hang). Imported here, it captures None (~10 ms).
import torch.distributed.nn

from stalwart.distributed.launch_env import env_int


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job.

    Attributes:
        rank: global rank (0 when not distributed).
        world_size: number of processes (1 when not distributed).
        local_rank: rank on this node (LOCAL_RANK under torchrun).
        device: the device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: ``"nccl"``, ``"gloo"`` or ``None`` when no process group exists.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable value)
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 and self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """World size announced by the launcher (torchrun sets WORLD_SIZE), 1 without one."""
    return env_int("WORLD_SIZE", 1, minimum=1)


def choose_device(local_rank: int, use_cpu: bool = False) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available and not disabled, else ``cpu``."""
    if not use_cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(
    use_cpu: bool = False,
    timeout_s: float = 600.0,
    backend: str | None = None,
    store: dist.Store | None = None,
) -> DistributedContext:
    """Initialise the default process group from torchrun's environment (or do nothing).

    Picks NCCL on CUDA and gloo on CPU unless ``backend`` is given, then runs one barrier-like
    all-reduce at once so that a half-initialised backend is never left behind (a later abort of
    a lazily-initialised NCCL communicator can hang).

    ``store`` (in-process restart): rendezvous through this store (a fresh namespace per attempt)
    with ``RANK``/``WORLD_SIZE`` from the environment, instead of ``env://``.

    Returns:
        The context; with WORLD_SIZE unset or 1 and no group requested, a single-process context.
    """
    world_size = env_world_size()
    local_rank = env_int("LOCAL_RANK", 0)
    device = choose_device(local_rank, use_cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size <= 1 and not dist.is_initialized():
        return DistributedContext(device=device)
    if not dist.is_initialized():
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        if store is None:
            store = torchrun_attempt_store(timeout_s)
        dist.init_process_group(
            backend=chosen,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            store=store,
            rank=-1 if store is None else env_int("RANK", 0, maximum=world_size - 1),
            world_size=-1 if store is None else world_size,
        )
    ctx = DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=str(dist.get_backend()),
    )
    # Deliberate sync: force the backend to finish initialising before any training work.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    return ctx


def torchrun_attempt_store(timeout_s: float) -> dist.Store | None:
    """A namespace of torchrun's shared store for this restart attempt; None outside torchrun.

    torchrun (torch >= 2.4) keeps ONE TCPStore across ``--max-restarts`` restarts and workers use
    it without a per-attempt prefix, so a restarted worker can read the process-group keys of the
    killed attempt (gloo peer addresses) and hang in ``init_process_group`` connecting to a dead
    peer. Prefixing every key with ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    restart = env_int("TORCHELASTIC_RESTART_COUNT", 0, maximum=1 << 31)
    base = dist.TCPStore(
        env.get("MASTER_ADDR", "127.0.0.1"),
        env_int("MASTER_PORT", 29500, minimum=1, maximum=65535),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"stalwart/attempt_{restart}", base)


def destroy_distributed() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
