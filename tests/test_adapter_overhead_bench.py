"""bench/adapter_overhead.py's side-by-side harness: another source tree's stalwart runs in the
same process without mixing with this one (the figures are the GPU's; this pins the harness)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from source_versions import SourceVersion  # type: ignore[import-not-found]  # noqa: E402


def test_a_source_version_swaps_its_own_modules_in_and_out(tmp_path: Path) -> None:
    tree = tmp_path / "src" / "stalwart"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("TREE = 'base'\n")
    (tree / "lazy.py").write_text("TREE = 'base lazy'\n")
    base = SourceVersion(str(tmp_path / "src"), "@base")
    with base.active():
        import stalwart as inside
        import stalwart.lazy as lazy  # imported inside: it stays with the version

        assert inside.TREE == "base" and lazy.TREE == "base lazy"
    assert sys.modules["stalwart"] is stalwart and not hasattr(stalwart, "TREE")
    assert "stalwart.lazy" not in sys.modules
    with base.active():  # the same module objects again, not a fresh import
        assert sys.modules["stalwart"] is inside and sys.modules["stalwart.lazy"] is lazy


@pytest.mark.timeout(600)
def test_the_same_tree_as_baseline_dispatches_the_same_ops(tmp_path: Path) -> None:
    """--ops with this tree as its own baseline: the variants of both versions count the same
    aten ops and Python calls per step (the harness mixes nothing), and the guarded step adds
    ops over plain Lightning (the count sees the checks)."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    import adapter_overhead  # type: ignore[import-not-found]

    src = str(Path(stalwart.__file__).resolve().parents[1])
    out = tmp_path / "ops.json"
    threads = torch.get_num_threads()
    try:
        _run(adapter_overhead, src, out)
    finally:  # the script sets both for its process
        logging.disable(logging.NOTSET)
        torch.set_num_threads(threads)
    ops = json.loads(out.read_text())["ops"]
    now, base = ops["lightning+stalwart"], ops["lightning+stalwart@base"]
    assert (now["top"], now["all"], now["calls"]) == (base["top"], base["all"], base["calls"])
    assert now["top"] > ops["lightning"]["top"]


def _run(adapter_overhead: Any, src: str, out: Path) -> None:
    adapter_overhead.main([
        "--device", "cpu", "--frameworks", "lightning", "--hidden", "16", "--layers", "1",
        "--batch", "1", "--seq", "8", "--warmup", "2", "--iters", "3", "--ops",
        "--baseline-src", src, "--json", str(out),
    ])  # fmt: skip
