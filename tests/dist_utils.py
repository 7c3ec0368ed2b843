"""Run a function on N gloo ranks in fresh processes (forkserver) and collect each rank's result.

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


# Ranks are forked from a fork server that has imported torch and stalwart once per test process
# (and never ran a torch op or started a thread): each rank is still a fresh process, without
# the ~4 s of CPU a spawned interpreter spends importing torch again.
PRELOAD = ["torch", "torch.distributed", "numpy", "stalwart.train.trainer",
           "stalwart.checkpoint", "stalwart.loop", "stalwart.reliability.rerun"]  # fmt: skip


def _context() -> Any:
    # STALWART_TEST_START_METHOD=spawn: the old way, to compare or to rule the fork server out.
    method = os.environ.get("STALWART_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method != "forkserver":
        return ctx
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first rank)
    return ctx


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple,
    queue: Any,
    environ: dict[str, str],
) -> None:
    import torch.distributed as dist

    # The parent's environment now, as a spawned rank would see it (not the server's at start).
    os.environ.clear()
    os.environ.update(environ)
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
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, fn, world_size, port, args, queue, environ), daemon=False
        )
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
