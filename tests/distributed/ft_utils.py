"""Helpers for torchrun fault-tolerance tests: a live torchrun job whose log can be watched."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from train_utils import REPO, cli_command, cli_env

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")


class LiveRun:
    """``stalwart`` under torchrun in its own session; a thread collects the merged output."""

    def __init__(
        self,
        args: list[str],
        *,
        nproc: int = 2,
        env: dict[str, str] | None = None,
        torchrun_args: list[str] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            cli_command(args, nproc=nproc, torchrun_args=torchrun_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(env),
            cwd=REPO,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Block until ``predicate()`` (checked on every output line and every 50 ms)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not predicate()):
                    raise AssertionError(
                        f"gave up waiting for {what}:\n{''.join(self.lines)[-4000:]}"
                    )
                self._cond.wait(min(left, 0.05))

    def wait_for_iteration(self, iteration: int, timeout: float = 90.0) -> None:
        def seen() -> bool:
            return any(
                (m := ITERATION_RE.search(line)) and int(m.group(1)) >= iteration
                for line in self.lines
            )

        self.wait_for(seen, timeout, f"iteration {iteration}")

    def signal_launcher(self, sig: signal.Signals) -> float:
        """Send ``sig`` to torchrun only (as a scheduler would); returns the send time."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        return sent

    def kill_all(self) -> None:
        """SIGKILL torchrun and every process below it at once (a node failure).

        torchrun starts each worker in a session of its own, so killing torchrun's process group
        would leave the workers running: collect the whole tree first.
        """
        import psutil

        try:
            tree = [psutil.Process(self.proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = 90.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.proc.wait()
            raise AssertionError(f"job did not end in {timeout}s:\n{self.output[-4000:]}") from None
        self._reader.join(5)
        return code

    def close(self) -> None:
        """Leave nothing behind (safe after the job ended)."""
        if self.proc.poll() is None:
            self.kill_all()
            self.proc.wait()


def logged_iterations(output: str) -> list[int]:
    return [int(m.group(1)) for m in ITERATION_RE.finditer(output)]


def read_tracker(save: Path) -> int:
    return int((save / "latest_checkpointed_iteration.txt").read_text())
