"""Warm restarts: torch's persistent compile caches in a directory the job owns
(:class:`CompileCache`, :mod:`stalwart.compile.cache`), the trust check of that directory
(:mod:`stalwart.compile.cache_trust`) and torch's compile counters (:class:`CompileCounts`).

No CUDA graph here (``stalwart.graphs`` captures; ``graphs.compile`` compiles a model for a
capture) and no goodput: the shell books compile time (``stalwart.loop.compile_booking``).
"""

from __future__ import annotations

from stalwart.compile.cache import (
    DEFAULT_CACHE_DIRNAME,
    CompileActivity,
    CompileCache,
    CompileCounts,
    NullCompileCache,
)
from stalwart.compile.cache_trust import check_cache_dir

__all__ = [
    "DEFAULT_CACHE_DIRNAME",
    "CompileActivity",
    "CompileCache",
    "CompileCounts",
    "NullCompileCache",
    "check_cache_dir",
]
