"""Run a function on N gloo ranks in fresh processes (spawn) and collect each rank's result.

Usage in a test::

    def _body(rank: int, world_size: int, tmp: str) -> float: ...
    results = run_distributed(_body, world_size=2, args=(str(tmp_path),))

The body runs with the default process group initialised (gloo, CPU). Exceptions in a rank fail
the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, queue: Any
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, fn, world_size, port, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed body failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
