"""The end-of-session guard of the test suite (`session_guard`, wired in conftest.py): what a
session leaves running is named, a failed test's objects are freed before the interpreter's
exit, and an exit that hangs ends with the stacks and code 1 instead of never."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import session_guard

TESTS = Path(__file__).resolve().parent


def test_a_leftover_non_daemon_thread_and_child_process_are_named() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="stuck-writer")  # non-daemon
    daemon = threading.Thread(target=stop.wait, name="a-daemon", daemon=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker.start()
    daemon.start()
    try:
        line = session_guard.leftovers()
        assert line is not None and "stuck-writer" in line and "a-daemon" not in line, line
        assert f"{child.pid} {sys.executable} -c import time" in line, line  # its command
        assert (child.pid, "python") in [(p, c[:6]) for p, c in session_guard.child_processes()]
    finally:
        stop.set()
        child.kill()
        child.wait()
        worker.join()
    line = session_guard.leftovers()
    assert line is None or ("stuck-writer" not in line and str(child.pid) not in line), line


def test_the_last_failures_frames_are_released() -> None:
    class Graph:  # stands in for a captured CUDA graph held by a failed test's frame
        pass

    def failing_test() -> None:
        graph = Graph()
        held.append(weakref.ref(graph))
        raise AssertionError("graph-vs-eager above the bound")

    held: list[weakref.ref[Graph]] = []
    try:
        failing_test()
    except AssertionError as exc:  # what pytest stores for a post-mortem debugger
        sys.last_value, sys.last_traceback = exc, exc.__traceback__
    assert held[0]() is not None
    session_guard.release_leftovers()
    assert held[0]() is None
    assert not hasattr(sys, "last_traceback")


HANGING_EXIT = """
import sys, threading
sys.path.insert(0, {tests!r})
import session_guard
threading.Thread(target=threading.Event().wait, name="never-ends").start()  # non-daemon
print("tests done", flush=True)
session_guard.arm_exit_watchdog(1.0)
"""


def test_an_exit_that_hangs_prints_the_stacks_and_ends_with_code_1() -> None:
    """A non-daemon thread that never ends: Python's exit waits for it forever; with the
    watchdog the process ends about a second later, naming where every thread was."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HANGING_EXIT.format(tests=str(TESTS)))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert time.monotonic() - start < 30
    assert done.stdout == "tests done\n"
    assert "Timeout" in done.stderr and "threading.py" in done.stderr, done.stderr


def test_the_watchdog_is_armed_only_in_the_pytest_command() -> None:
    main = session_guard.is_pytest_main_process
    assert main(["/venv/bin/pytest", "-q"], {})
    assert main(["/venv/lib/python3.11/site-packages/pytest/__main__.py"], {})
    assert not main(["/venv/bin/pytest"], {"PYTEST_XDIST_WORKER": "gw0"})
    assert not main(["train.py"], {})  # pytest.main() inside another program
    assert session_guard.exit_timeout({}) == session_guard.DEFAULT_EXIT_TIMEOUT_S
    assert session_guard.exit_timeout({session_guard.EXIT_TIMEOUT_ENV: "0"}) == 0.0
    assert session_guard.exit_timeout({session_guard.EXIT_TIMEOUT_ENV: "soon"}) == 120.0
    assert not session_guard.arm_exit_watchdog(0.0)


def test_a_compile_pool_that_ignores_its_shutdown_is_killed_not_waited_for() -> None:
    # Inductor's compile workers: a sidecar process per pool, which torch's exit handler waits
    # up to 300 s for. Stopped (SIGSTOP), it cannot answer the shutdown: the guard kills it
    # after its timeout, and the interpreter's exit then waits for nothing.
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(TESTS)!r})
        import session_guard
        import torch._inductor.async_compile as compile_pools
        from torch._inductor import config
        config.worker_start_method = "subprocess"
        config.compile_threads = 2
        pool = compile_pools.AsyncCompile.process_pool()
        os.kill(pool.process.pid, signal.SIGSTOP)
        began = time.monotonic()
        killed = session_guard.stop_compile_workers(timeout_s=2)
        print("killed", killed == [pool.process.pid], time.monotonic() - began < 20,
              len(compile_pools._pool_set))
        """
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "killed True True 0" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert time.monotonic() - began < 90  # not torch's 300 s wait at the exit
