"""No import cycle inside ``stalwart.reliability``, type-only imports included.

The scan parses every module of ``src/stalwart/reliability`` with ``ast`` and follows every
import of another reliability module: at module level, inside ``if TYPE_CHECKING:`` and inside
functions alike (a function-local import only hides a cycle until the function runs). A package's
own ``__init__`` is not an implicit edge: ``import a.b.c`` counts as an edge to ``a.b.c`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "stalwart.reliability"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module ``node`` imports from, relative imports resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that ``source`` (module ``module``) imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            submodules = {f"{target}.{a.name}" for a in node.names} & known
            found |= submodules or {target}
    return {name for name in found if name in known and name != module}


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules it imports, for ``sources`` (module -> (text, is_package))."""
    known = set(sources)
    return {m: imports_of(text, m, known, pkg) for m, (text, pkg) in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        if start in done:
            continue
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def _reliability_sources() -> dict[str, tuple[str, bool]]:
    paths = sorted((SRC / "stalwart" / "reliability").rglob("*.py"))
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in paths}


def test_reliability_has_no_import_cycle() -> None:
    graph = import_graph(_reliability_sources())
    assert len(graph) > 20 and any(graph.values())  # the scan saw the package and its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_scan_finds_type_only_and_function_local_cycles() -> None:
    a = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from stalwart.reliability.x.b import B\n"
    )
    b = "def f():\n    from . import c\n"
    c = "from stalwart.reliability.x import a\n"
    sources = {
        "stalwart.reliability.x": ("", True),
        "stalwart.reliability.x.a": (a, False),
        "stalwart.reliability.x.b": (b, False),
        "stalwart.reliability.x.c": (c, False),
    }
    graph = import_graph(sources)
    assert graph["stalwart.reliability.x.a"] == {"stalwart.reliability.x.b"}
    assert graph["stalwart.reliability.x.b"] == {"stalwart.reliability.x.c"}
    assert find_cycle(graph) == [
        "stalwart.reliability.x.a",
        "stalwart.reliability.x.b",
        "stalwart.reliability.x.c",
        "stalwart.reliability.x.a",
    ]
    del sources["stalwart.reliability.x.c"]
    assert find_cycle(import_graph(sources)) is None


def test_reliability_does_not_import_the_checkpoint_package() -> None:
    bad = []
    for module, (text, pkg) in _reliability_sources().items():
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [_absolute(node, module, pkg)]
            bad += [
                f"{module} imports {n}"
                for n in names
                if n.split(".")[:2] == ["stalwart", "checkpoint"]
            ]
    assert not bad, "; ".join(bad)
