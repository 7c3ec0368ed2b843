"""Warm restarts: torch's own persistent compile caches, in a directory the job owns.

A relaunch after a fault is a new process: without a cache it compiles the model again (52-72 s
of the first iteration at gpt2-124m with ``--compile`` on one H200). `CompileCache` points
torch's caches at one directory for the life of a run:

* the FX-graph cache (``torch._inductor.config.fx_graph_cache``) and the AOTAutograd cache
  (``torch._functorch.config.enable_autograd_cache``), switched on, under ``<dir>/inductor``
  (``TORCHINDUCTOR_CACHE_DIR`` while the cache is open, restored at close; Inductor's Triton
  kernels and C++ libraries land there too);
* torch's mega-cache (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``, where
  the running torch has them): ``<dir>/artifacts.bin``, every artifact this process compiled,
  written atomically (temporary file, fsync, rename) after an iteration that compiled, by one
  writer; loaded when the cache opens, so a directory that lost its ``inductor/`` entries (or a
  copy of only the file) still starts warm. Without the API the file is neither written nor read.
  Loading writes every artifact into ``inductor/`` again: where ``inductor/`` already holds them
  (``inductor/artifacts.stamp`` names the size and modification time of the ``artifacts.bin``
  whose entries it holds: written after a save or a load) the load is skipped; a relaunch on
  the node that compiled does not pay it. An entry deleted by hand from ``inductor/`` is then
  compiled again, not loaded: slower, the same code.

A warm relaunch still runs Dynamo's trace (its guards live in the process); AOTAutograd's trace
and Inductor's code generation and compilation come from the cache. An in-process restart keeps
even that: Dynamo keeps compiled code on the code objects of the model's class, and the rebuilt
model (same class, shapes and flags) passes the same guards, so the restarted attempt compiles
nothing. Open the cache outside the restartable scope and pass it in (`CompileCache` is the
collaborator; nothing here is module state).

Trust. Inductor's caches hold generated code that the process imports and runs (Python modules,
shared libraries, pickled graphs), so a cache directory is code. It must be one that only this
job's user can write, for the whole run: `check_cache_dir` refuses, in one line (``ValueError``),
a directory that is a symbolic link, another user's, or writable by its group or everyone; one
with anything below it that is a link, another user's or writable by others who can reach it;
one under a directory that another user owns or can write without the sticky bit (they could
swap the cache after the check: `stalwart.compile.cache_trust` says why the whole path is judged);
one inside a checkpoint directory. `CompileCache` judges it again when it opens, right before
the first load and compile. A new directory is created with mode 0700, the file with 0600. The
default lives under the run directory. A cache copied from elsewhere becomes the copier's own:
copy a run directory without its ``compile_cache/`` unless you trust whoever wrote it. A damaged
``artifacts.bin`` is one warning line; the run compiles without it and writes it again.

    >>> import tempfile
    >>> import torch
    >>> cache = CompileCache(tempfile.mkdtemp())
    >>> with cache:
    ...     before = CompileCounts.read()
    ...     fn = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    ...     _ = fn(torch.ones(3))
    ...     compiled = CompileCounts.read().since(before)
    ...     wrote = cache.save()                  # after the first compiled iteration
    >>> compiled.frames
    1
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from stalwart.atomic_file import Sync, write_bytes_atomic
from stalwart.compile.cache_trust import ARTIFACTS_FILE, INDUCTOR_DIR, check_cache_dir
from stalwart.fixed_paths import FixedPath
from stalwart.regular_file import open_regular

logger = logging.getLogger("stalwart.compile_cache")

STAMP_FILE = "artifacts.stamp"  # in INDUCTOR_DIR: the artifacts.bin whose entries it holds
DEFAULT_CACHE_DIRNAME = "compile_cache"  # under the run directory
_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class CompileCounts:
    """torch's compile counters (``torch._dynamo.utils.counters``), or a difference of two reads.

    ``frames``: frames Dynamo compiled; ``fx_*``: Inductor's FX-graph cache; ``aot_*``: the
    AOTAutograd cache. A read is a few dictionary lookups (no device work).
    """

    frames: int = 0
    fx_hits: int = 0
    fx_misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0

    @classmethod
    def read(cls) -> CompileCounts:
        from torch._dynamo.utils import counters

        inductor, aot = counters["inductor"], counters["aot_autograd"]
        return cls(
            frames=int(counters["frames"]["ok"]),
            fx_hits=int(inductor["fxgraph_cache_hit"]),
            fx_misses=int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]),
            aot_hits=int(aot["autograd_cache_hit"]),
            aot_misses=int(aot["autograd_cache_miss"] + aot["autograd_cache_bypass"]),
        )

    def since(self, earlier: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.frames - earlier.frames,
            self.fx_hits - earlier.fx_hits,
            self.fx_misses - earlier.fx_misses,
            self.aot_hits - earlier.aot_hits,
            self.aot_misses - earlier.aot_misses,
        )

    @property
    def compiled(self) -> bool:
        """Whether anything was compiled or loaded from the cache (Dynamo traced a frame)."""
        return self.frames > 0 or self.fx_misses > 0 or self.fx_hits > 0

    @property
    def warm(self) -> bool:
        """Every Inductor graph came from the cache (at least one hit, no miss); else cold (a
        miss, or a backend that does not cache)."""
        return self.fx_hits > 0 and self.fx_misses == 0

    def fields(self) -> dict[str, int]:
        """The counters by their record names (``fx_hit``, ...)."""
        return {
            "frames": self.frames,
            "fx_hit": self.fx_hits,
            "fx_miss": self.fx_misses,
            "aot_hit": self.aot_hits,
            "aot_miss": self.aot_misses,
        }


class CompileCache:
    """torch's compile caches in ``directory`` while open (see the module docstring).

    ``writer``: whether this process writes ``artifacts.bin`` (one rank per job: the entries
    under ``inductor/`` are written by every process with Inductor's own atomic writes).
    ``flag`` names the setting in error messages. Use as a context manager, or ``open`` /
    ``close``; ``close`` is idempotent.
    """

    inductor_dir = FixedPath("directory", INDUCTOR_DIR)
    artifacts_file = FixedPath("directory", ARTIFACTS_FILE)
    stamp_file = FixedPath("directory", INDUCTOR_DIR, STAMP_FILE)

    def __init__(
        self, directory: str | os.PathLike[str], *, writer: bool = True, flag: str = "compile cache"
    ) -> None:
        check_cache_dir(flag, directory)
        # The real path: what was judged (every directory above it) is what torch reads.
        self.directory = Path(os.path.realpath(directory))
        self.writer = writer
        self.flag = flag
        self._stack: contextlib.ExitStack | None = None
        self._saved_frames = -1  # Dynamo's frame count at the last save
        self.loaded_artifacts = 0  # by the last open (0: warm from inductor/ itself, or cold)
        self._damaged = False  # artifacts.bin failed to load: rewritten after the next compile

    def has_artifacts(self) -> bool:
        """Whether ``artifacts.bin`` holds this cache's artifacts (False when it is missing, or
        failed to load: the next compiling iteration writes it again)."""
        return self.artifacts_file.is_file() and not self._damaged

    def open(self) -> CompileCache:
        """Switch the caches on and point them here; load ``artifacts.bin`` if present.

        The directory is judged again first (``ValueError``), at its use: before the first
        load and compile (the module docstring of `stalwart.compile.cache_trust` says why that
        judgement then holds for the whole run)."""
        if self._stack is not None:
            return self
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        check_cache_dir(self.flag, self.directory)  # before creating anything in it
        for path in (self.directory, self.inductor_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        stack.enter_context(inductor_config.patch(fx_graph_cache=True))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=True))
        stack.callback(_restore_env, _ENV, os.environ.get(_ENV))
        os.environ[_ENV] = str(self.inductor_dir)
        self._stack = stack
        self._saved_frames = CompileCounts.read().frames  # save() writes after new compiles only
        self.loaded_artifacts = self._load()
        return self

    def close(self) -> None:
        """Restore torch's settings and ``TORCHINDUCTOR_CACHE_DIR`` (idempotent)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def load(self) -> int:
        """Hot-load ``artifacts.bin`` into the caches (``torch.compiler.load_cache_artifacts``);
        returns the number of artifacts loaded (0: no file, no API, a damaged file, or
        ``inductor/`` already holds this file's entries: its stamp matches). The directory is
        judged first (``ValueError``): the file may be new since the cache opened."""
        check_cache_dir(self.flag, self.directory)
        return self._load()

    def _load(self) -> int:
        import torch

        loader = getattr(torch.compiler, "load_cache_artifacts", None)
        if loader is None or not self.artifacts_file.is_file():
            return 0
        if self._stamp_matches():
            return 0
        try:
            with open_regular(self.artifacts_file) as f:
                data = f.read()
            with _TorchCacheLog() as torch_log:
                info = loader(data)
        except Exception as exc:  # a torn or foreign file must not stop a run: compile cold
            return self._not_loaded(f"{type(exc).__name__}: {exc}")
        if info is None:  # torch logged why (a traceback), and loaded nothing
            return self._not_loaded(torch_log.reason or "torch could not read it")
        self._damaged = False
        self._write_stamp()
        return _artifact_count(info)

    def _not_loaded(self, reason: str) -> int:
        """One line for an ``artifacts.bin`` that did not load; nothing is stamped, and the
        file is written again after the next iteration that compiles."""
        self._damaged = True
        first = reason.strip().splitlines()[0] if reason.strip() else "unknown reason"
        shown = first if len(first) <= 160 else first[:157] + "..."
        logger.warning(
            "compile cache: %s is damaged or not torch's (%s); not loaded: this run compiles "
            "without it and writes it again after its first compiled iteration",
            self.artifacts_file,
            shown,
        )
        return 0

    def _file_id(self) -> dict[str, int] | None:
        """``artifacts.bin``'s size and modification time (None without the file)."""
        try:
            st = self.artifacts_file.stat()
        except OSError:
            return None
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def _stamp_matches(self) -> bool:
        """Whether ``inductor/`` holds the entries of the ``artifacts.bin`` there is now."""
        current = self._file_id()
        try:
            with open_regular(self.stamp_file) as f:  # a planted FIFO must not hang the start
                stamped = json.loads(f.read(4096))  # plain JSON: nothing in it runs
        except (OSError, ValueError):
            return False
        return current is not None and stamped == current

    def _write_stamp(self) -> None:
        """After a save or a load: ``inductor/`` holds the entries of ``artifacts.bin``."""
        current = self._file_id()
        if current is None:
            return
        try:
            write_bytes_atomic(
                self.stamp_file, json.dumps(current).encode(), sync=Sync.FILE, mode=0o600
            )
        except OSError as exc:  # only the next relaunch's shortcut is lost
            logger.warning("compile cache: %s not written (%s)", self.stamp_file, exc)

    def save(self) -> bool:
        """Write every artifact compiled so far to ``artifacts.bin`` (atomic: a temporary file,
        fsync, rename); nothing when not the writer, without the API, or when Dynamo compiled
        nothing since the last save. Returns whether it wrote. Call after an iteration that
        compiled, outside the timed step."""
        import torch

        frames = CompileCounts.read().frames
        saver = getattr(torch.compiler, "save_cache_artifacts", None)
        if not self.writer or saver is None or frames == self._saved_frames:
            return False
        self._saved_frames = frames
        result = saver()
        if result is None:  # nothing recorded (every graph came from in-memory caches)
            return False
        # Mode 0600, as the cache directory is 0700: what is loaded back stays this user's.
        write_bytes_atomic(self.artifacts_file, result[0], sync=Sync.FILE, mode=0o600)
        self._damaged = False
        self._write_stamp()  # this process compiled into inductor/: it holds them all
        return True

    def __enter__(self) -> CompileCache:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NullCompileCache:
    """No compile cache (``--compile`` off): the same surface, nothing happens."""

    directory = None
    writer = False

    def open(self) -> NullCompileCache:
        return self

    def close(self) -> None: ...

    def load(self) -> int:
        return 0

    def save(self) -> bool:
        return False

    def has_artifacts(self) -> bool:
        return True

    def __enter__(self) -> NullCompileCache:
        return self

    def __exit__(self, *exc: object) -> None: ...


class CompileActivity:
    """Progress while torch compiles, for a watchdog that would take a long compile for a hang.

    Calling it returns a value that changes at every call while a compile runs (torch's compile
    start/end callbacks, ``torch._dynamo.callback_handler``: Dynamo's frames and AOTAutograd's
    deferred backward), and torch's compile counters otherwise. Give it as the in-process
    restart's ``activity`` (`stalwart.reliability.inprocess.Attempt.set_progress`): a cold
    compile (52-72 s at gpt2-124m on an H200, longer than the default 60 s soft timeout) is not
    a hang. A rank hung inside a compile is then caught by its peers' watchdogs (they wait for
    it in a collective), not by its own. Without the callbacks (an older torch) it follows the
    counters only. ``close`` removes the callbacks (idempotent).
    """

    def __init__(self) -> None:
        self._active = 0
        self._ticks = 0
        self._handler: Any = None
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return
        if hasattr(callback_handler, "remove_start_callback"):
            callback_handler.register_start_callback(self._started)
            callback_handler.register_end_callback(self._ended)
            self._handler = callback_handler

    def _started(self, *args: object) -> None:
        self._active += 1

    def _ended(self, *args: object) -> None:
        self._active = max(self._active - 1, 0)

    @property
    def compiling(self) -> bool:
        return self._active > 0

    def __call__(self) -> object:
        if self._active > 0:
            self._ticks += 1
            return ("compiling", self._ticks)
        return CompileCounts.read()

    def close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            with contextlib.suppress(ValueError):
                handler.remove_start_callback(self._started)
                handler.remove_end_callback(self._ended)


class _TorchCacheLog(logging.Filter):
    """While active, keeps torch's own report of an unreadable ``artifacts.bin`` (a warning with
    a 10-line traceback on ``torch.compiler._cache``) off the terminal, and keeps its reason for
    our one line."""

    _LOGGER = "torch.compiler._cache"

    def __init__(self) -> None:
        super().__init__()
        self.reason = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        self.reason = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
        return False

    def __enter__(self) -> _TorchCacheLog:
        logging.getLogger(self._LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self._LOGGER).removeFilter(self)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _artifact_count(info: Any) -> int:
    artifacts = getattr(info, "artifacts", None)
    if isinstance(artifacts, dict):
        return sum(len(v) for v in artifacts.values())
    return 0 if info is None else 1


__all__ = [
    "ARTIFACTS_FILE",
    "DEFAULT_CACHE_DIRNAME",
    "INDUCTOR_DIR",
    "STAMP_FILE",
    "CompileActivity",
    "CompileCache",
    "CompileCounts",
    "NullCompileCache",
    "check_cache_dir",
]
