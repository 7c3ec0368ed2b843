"""What a test session leaves behind, and a watchdog on the interpreter's exit (conftest.py).

``pytest -m gpu tests`` once printed its summary and then did not exit within 390 s. A failed
test's objects outlive it: pytest keeps the failure's traceback (``sys.last_traceback``, for a
debugger) until the next test starts, and objects in a reference cycle live until a full
collection, possibly until the interpreter's shutdown, where destroying CUDA graphs, streams
or communicators is not safe. So at the end of a session:

* `release_leftovers`: the last failure's frames are dropped and garbage is collected while the
  process (and CUDA) is whole, then CUDA is synchronized;
* `leftovers`: the non-daemon threads still running (Python waits for each at exit) and the
  child processes still alive, one line for the summary;
* `arm_exit_watchdog`: if the interpreter's exit then takes longer than the limit, every
  thread's stack is printed and the process ends with exit code 1 instead of hanging.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading

EXIT_TIMEOUT_ENV = "STALWART_TEST_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 120.0
COMPILE_POOL_TIMEOUT_S = 20.0


def release_leftovers() -> None:
    """Drop the last failed test's frames, collect cyclic garbage, synchronize CUDA, stop
    Inductor's compile workers."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    stop_compile_workers()


def stop_compile_workers(timeout_s: float = COMPILE_POOL_TIMEOUT_S) -> list[int]:
    """Shut Inductor's compile-worker pools down now, each within ``timeout_s``; the pid of
    each one's process that had to be killed.

    Torch shuts them down at the interpreter's exit (an ``atexit`` handler), waiting up to
    300 s for each pool's process. A GPU session left three such children running after its
    summary and did not exit within 390 s: a pool that does not answer its shutdown holds the
    exit for minutes. Here each pool gets ``timeout_s``, then its process is killed, and the
    pools are forgotten so that the exit handler waits for none of them."""
    compile_pools = sys.modules.get("torch._inductor.async_compile")
    if compile_pools is None:
        return []
    killed = []
    for pool in list(getattr(compile_pools, "_pool_set", ())):
        stopping = threading.Thread(target=pool.shutdown, name="compile-pool-shutdown")
        stopping.daemon = True
        stopping.start()
        stopping.join(timeout_s)
        process = getattr(pool, "process", None)  # SubprocPool's sidecar (a Popen)
        if stopping.is_alive() and process is not None and process.poll() is None:
            process.kill()  # the thread's wait then returns
            process.wait()
            killed.append(process.pid)
    compile_pools.after_fork()  # forget the pools (torch's name for it): nothing left to wait for
    return killed


def leftover_threads() -> list[threading.Thread]:
    """Threads other than the main one that the interpreter's exit waits for."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]


def child_processes(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, name) of the live children of ``pid`` (default: this process); Linux ``/proc``."""
    parent = os.getpid() if pid is None else pid
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        comm = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == parent:
            found.append((int(name), comm))
    return sorted(found)


def _command_line(pid: int, comm: str) -> str:
    """The first 100 characters of the process's command line (its name if unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return comm
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text[:100] or comm


# multiprocessing's own helpers (DataLoader workers' forkserver, the resource tracker) read a pipe
# from this process and end when it closes: they never hold the exit, so they are not reported.
_STDLIB_HELPERS = ("multiprocessing.forkserver import main", "multiprocessing.resource_tracker")


def _exits_with_us(command_line: str) -> bool:
    return any(helper in command_line for helper in _STDLIB_HELPERS)


def leftovers() -> str | None:
    """One line naming what is still running at the end of the session, or None."""
    threads = [t.name for t in leftover_threads()]
    commands = [(pid, _command_line(pid, comm)) for pid, comm in child_processes()]
    children = [f"{pid} {line}" for pid, line in commands if not _exits_with_us(line)]
    if not threads and not children:
        return None
    parts = []
    if threads:
        parts.append(
            f"{len(threads)} non-daemon thread(s) the exit waits for: {', '.join(threads)}"
        )
    if children:
        parts.append(f"{len(children)} child process(es): {', '.join(children)}")
    return "left running at the end of the session: " + "; ".join(parts)


def exit_timeout(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """``$STALWART_TEST_EXIT_TIMEOUT`` seconds (0: no watchdog), else the default."""
    text = environ.get(EXIT_TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S
    return value if value >= 0 else DEFAULT_EXIT_TIMEOUT_S


def is_pytest_main_process(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this process is the ``pytest`` command itself (not an xdist worker, not a
    ``pytest.main()`` inside another program, which must not be ended by the watchdog)."""
    if environ.get("PYTEST_XDIST_WORKER"):
        return False
    program = argv[0] if argv else ""
    return os.path.basename(program) in ("pytest", "py.test") or program.endswith(
        os.path.join("pytest", "__main__.py")
    )


def arm_exit_watchdog(timeout_s: float) -> bool:
    """After ``timeout_s`` more seconds in this process, print every thread's stack and exit
    with code 1 (``faulthandler``: it also fires while the interpreter is shutting down)."""
    if timeout_s <= 0 or sys.__stderr__ is None:
        return False
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.__stderr__)
    return True
