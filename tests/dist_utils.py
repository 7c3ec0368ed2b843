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
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Ranks are forked from a fork server that has imported torch and stalwart once per test process
# (and never ran a torch op or started a thread): each rank is still a fresh process, without
# the ~4 s of CPU a spawned interpreter spends importing torch again.
# torch._dynamo: DDP's constructor imports it (~2 s of CPU, sympy included), so every rank that
# trains would pay it; measured per forked `stalwart train` rank: 1.8 -> 0.6 CPU s.
# torch.distributed.checkpoint is imported lazily by stalwart (on the first save or load): most
# forked ranks save, so the server imports it once for all of them (~0.1 s after torch._dynamo).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "stalwart.train.trainer",
           "stalwart.checkpoint", "stalwart.loop", "stalwart.reliability.rerun",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "stalwart.checkpoint.dcp_readers"]  # fmt: skip


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


class RankExits:
    """What `run_cli_on_ranks` saw: each rank's process exit code and its output.

    ``returncode``: 0 when every rank exited 0, else the first failing rank's code (the root
    cause torchrun reports). ``stdout``/``stderr``: every rank's stream, rank 0 first.
    """

    def __init__(self, codes: list[int], first_failure: int, outs: list[str], errs: list[str]):
        self.codes = codes
        self.returncode = first_failure
        self.stdout = "".join(outs)
        self.stderr = "".join(errs)

    @property
    def log(self) -> str:
        return self.stdout + self.stderr


def record_checkpoint_reads(report: str, root: str) -> None:
    """For a rank (``run_cli_on_ranks(prelude=...)``): append to ``report`` the path of every
    file inside a checkpoint directory (``iter_NNNNNNN``, tmp directories excluded) under
    ``root`` that this process opens for reading, as the interpreter's audit events see them
    (``open``, ``os.open``; an audit hook stays for the process's life)."""
    import re
    import sys

    roots = "|".join(re.escape(r) for r in {os.path.abspath(root), os.path.realpath(root)})
    inside = re.compile(rf"^(?:{roots})/(?:.+/)?iter_\d{{7,}}/")
    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or len(args) < 3 or not isinstance(args[0], str):
            return
        mode, flags = args[1], args[2]
        reading = (mode is None and isinstance(flags, int) and flags & 3 == os.O_RDONLY) or (
            isinstance(mode, str) and "r" in mode and "+" not in mode
        )
        if reading and inside.match(args[0]):
            os.write(fd, (args[0] + "\n").encode())

    sys.addaudithook(hook)


def _cli_rank(
    argv: list[str],
    environ: dict[str, str],
    cwd: str,
    out_path: str,
    err_path: str,
    prelude: Callable[[], None] | None = None,
) -> None:
    # The rank's stdout and stderr go to files at the descriptor level, as a torchrun worker's
    # go to torchrun's, so C-level output (gloo, faulthandler) is kept too.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)  # the caller's, not the fork server's
    for path, fd in ((out_path, 1), (err_path, 2)):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    if prelude is not None:
        prelude()
    from stalwart.cli.main import main

    raise SystemExit(main(argv))  # the process exit code, as `python -m stalwart` gives it


def run_cli_on_ranks(
    argv: list[str],
    log_dir: str | os.PathLike[str],
    *,
    world_size: int = 2,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    timeout_s: float = 180.0,
    grace_s: float = 30.0,
    prelude: Callable[[], None] | None = None,
) -> RankExits:
    """``stalwart <argv>`` on ``world_size`` ranks, each a fresh process forked from the fork
    server (torch already imported), with torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: the CLI initialises the group itself).

    For launches that test the CLI on several ranks, not torchrun itself (no restarts, no
    signals to a launcher): a torchrun launch costs ~4 s of CPU per process importing torch.
    As torchrun does, once a rank has failed the others get ``grace_s`` to exit before they
    are killed (their code is then -9); past ``timeout_s`` every rank left is killed.
    ``log_dir/rank<N>.out|.err`` keep the output; ``unset``: variables of this process's
    environment the ranks do not inherit. ``world_size=1``: one process without torchrun's
    variables, as ``python -m stalwart`` runs (a fresh process, without its torch import).
    ``prelude``: a picklable function each rank calls before the CLI (a test's audit hook).
    """
    ctx = _context()
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k not in unset}
    base = {**inherited, "OMP_NUM_THREADS": "1", **(env or {})}
    os.makedirs(log_dir, exist_ok=True)
    paths = [
        (os.path.join(log_dir, f"rank{r}.out"), os.path.join(log_dir, f"rank{r}.err"))
        for r in range(world_size)
    ]
    procs = []
    for rank in range(world_size):
        torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                    "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0"}  # fmt: skip
        environ = {**base, **torchrun} if world_size > 1 else base
        args = (argv, environ, os.getcwd(), *paths[rank], prelude)
        procs.append(ctx.Process(target=_cli_rank, args=args))
    for p in procs:
        p.start()
    first_failure = 0
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed and not first_failure:
                first_failure = int(failed[0])
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    codes = [int(p.exitcode if p.exitcode is not None else -9) for p in procs]
    first_failure = first_failure or next((c for c in codes if c != 0), 0)
    outs, errs = ([Path(pair[i]).read_text(errors="replace") for pair in paths] for i in (0, 1))
    return RankExits(codes, first_failure, outs, errs)
