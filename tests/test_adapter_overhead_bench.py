"""bench/adapter_overhead.py's side-by-side harness: another source tree's stalwart runs in the
same process without mixing with this one (the figures are the GPU's; this pins the harness)."""

from __future__ import annotations

import sys
from pathlib import Path

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
