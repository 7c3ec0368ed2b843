"""The architecture rules of docs/architecture.md, checked on the source (AST scan of the package).

1. No function over ~60 lines (the loop reads on one screen).
2. The components never import the trainer, the CLI or its run config: any user's loop can
   compose them.
3. Some arrows between components are forbidden (`FORBIDDEN_ARROWS`: a runtime probe does not
   know the reference model, ...), and no import cycle joins two components.
4. No import cycle joins two modules of the package (the helper's side is typed by a Protocol
   where it must know its owner).

Every import counts: inside ``if TYPE_CHECKING:``, inside functions, re-exports.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stalwart"
MAX_FUNCTION_LINES = 60
COMPONENTS = (
    "reliability",
    "observability",
    "graphs",
    "compile",
    "checkpoint",
    "data",
    "models",
    "distributed",
    "loop",
    "integrations",
    "report",
)
FORBIDDEN = ("stalwart.train", "stalwart.cli", "stalwart.config.run")
# module (relative to the package) -> why it may still import the trainer side. Keep it short.
IMPORT_EXCEPTIONS: dict[str, str] = {}
# (importer, imported) components that must not depend on each other that way: observability
# measures any model (the reference GPT's memory formula is in models/), graphs checks any
# model's settings, observability needs no reliability (the RNG capture is the leaf
# stalwart.rng_state), reliability writes its verdicts without the checkpoint package, the
# integrations take their settings from the library, not from the trainer's config package, and
# neither the graphs nor the compile cache book goodput (the shell in loop/ does).
FORBIDDEN_ARROWS = frozenset(
    {
        ("observability", "models"),
        ("graphs", "models"),
        ("observability", "reliability"),
        ("reliability", "checkpoint"),
        ("integrations", "config"),
        ("graphs", "observability"),
        ("compile", "observability"),
    }
)
# "module:function" -> why it may be longer. Keep it short.
LENGTH_EXCEPTIONS: dict[str, str] = {}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_function_is_longer_than_a_screen() -> None:
    long, exempted = [], set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                key = f"{path.relative_to(PACKAGE)}:{node.name}"
                if lines > MAX_FUNCTION_LINES and key in LENGTH_EXCEPTIONS:
                    exempted.add(key)
                elif lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert not long, "functions over 60 lines: " + ", ".join(long)
    stale = sorted(set(LENGTH_EXCEPTIONS) - exempted)
    assert not stale, "exceptions no longer needed (remove them): " + ", ".join(stale)


def test_components_do_not_import_the_trainer_the_cli_or_the_run_config() -> None:
    bad = []
    for path in _modules():
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] not in COMPONENTS or str(relative) in IMPORT_EXCEPTIONS:
            continue
        for name in _imported(ast.parse(path.read_text())):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                bad.append(f"{relative} imports {name}")
    assert not bad, "; ".join(bad)


def test_the_checks_can_fail() -> None:
    """The scan sees what it must: a forbidden import and a long function in a sample."""
    sample = "import stalwart.train.trainer\ndef f():\n" + "    x = 1\n" * 70
    tree = ast.parse(sample)
    assert "stalwart.train.trainer" in _imported(tree)
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert func.end_lineno is not None and func.end_lineno - func.lineno + 1 > MAX_FUNCTION_LINES


def test_exceptions_are_real() -> None:
    for module in IMPORT_EXCEPTIONS:
        assert (PACKAGE / module).exists(), f"{module}: stale exception"


def _arrows() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) top-level parts of the package -> the modules that draw the arrow."""
    arrows: dict[tuple[str, str], set[str]] = {}
    for path in _modules():
        relative = path.relative_to(PACKAGE)
        source = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for name in _imported(ast.parse(path.read_text())):
            parts = name.split(".")
            if parts[0] == "stalwart" and len(parts) > 1 and parts[1] != source:
                arrows.setdefault((source, parts[1]), set()).add(relative.as_posix())
    return arrows


def test_no_forbidden_arrow_between_components() -> None:
    bad = [
        f"{module} ({arrow[0]} -> {arrow[1]})"
        for arrow, modules in sorted(_arrows().items())
        if arrow in FORBIDDEN_ARROWS
        for module in sorted(modules)
    ]
    assert not bad, "forbidden imports: " + ", ".join(bad)


def _cycle(edges: set[tuple[str, str]]) -> list[str]:
    """One cycle of the directed graph ``edges`` (its nodes, the first repeated last), or []."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycle_between_components() -> None:
    arrows = _arrows()
    edges = {(a, b) for a, b in arrows if a in COMPONENTS and b in COMPONENTS}
    cycle = _cycle(edges)
    where = [f"{a} -> {b} ({sorted(arrows[a, b])[0]})" for a, b in itertools.pairwise(cycle)]
    assert not cycle, "import cycle between components: " + "; ".join(where)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(tree: ast.AST, module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``tree`` (the module ``module``) imports: ``from a.b import c``
    imports the module ``a.b.c`` if there is one, else ``a.b`` (its ``__init__``)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                package = module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join([*package[:-1], *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else owner(base))
    return {name for name in found if name is not None and name != module}


def test_no_import_cycle_between_modules() -> None:
    paths = {_module_name(path): path for path in _modules()}
    edges = {
        (module, imported)
        for module, path in paths.items()
        for imported in _module_imports(ast.parse(path.read_text()), module, set(paths))
    }
    cycle = _cycle(edges)
    assert not cycle, "import cycle between modules: " + " -> ".join(cycle)


def test_the_module_cycle_check_can_fail() -> None:
    """A type-only import and a function-level import back make a cycle of two modules."""
    modules = {"stalwart.a", "stalwart.b", "stalwart.pkg", "stalwart.pkg.c"}
    a = "if TYPE_CHECKING:\n    from stalwart.b import B\n"
    b = "def f():\n    from stalwart.a import A\n"
    c = "from stalwart.pkg import d\nfrom . import c\n"
    assert _module_imports(ast.parse(a), "stalwart.a", modules) == {"stalwart.b"}
    assert _module_imports(ast.parse(b), "stalwart.b", modules) == {"stalwart.a"}
    assert _module_imports(ast.parse(c), "stalwart.pkg.c", modules) == {"stalwart.pkg"}
    edges = {("stalwart.a", "stalwart.b"), ("stalwart.b", "stalwart.a")}
    assert _cycle(edges) == ["stalwart.a", "stalwart.b", "stalwart.a"]


def test_the_arrow_checks_can_fail() -> None:
    """The cycle finder finds a cycle of three and a mutual import, and none in a DAG."""
    assert _cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert _cycle({("x", "y"), ("y", "x")}) == ["x", "y", "x"]
    assert _cycle({("a", "b"), ("a", "c"), ("b", "c")}) == []
    sample = "if TYPE_CHECKING:\n    from stalwart.models import GPT\ndef f():\n    import stalwart.reliability\n"
    assert _imported(ast.parse(sample)) == ["stalwart.models", "stalwart.reliability"]


def test_the_report_reader_and_renderer_do_not_import_each_other() -> None:
    """``report.run_report`` loads, ``report.html`` renders; both use ``run_dir``'s vocabulary."""
    for name in ("html", "plotly_charts", "svg"):
        imported = _imported(ast.parse((PACKAGE / "report" / f"{name}.py").read_text()))
        assert "stalwart.report.run_report" not in imported, name
        assert "stalwart.report" not in imported, name
    html = _imported(ast.parse((PACKAGE / "report" / "html.py").read_text()))
    assert "stalwart.observability.run_dir" in html


def test_the_hang_monitor_script_imports_nothing_of_stalwart() -> None:
    """The worker starts ``monitor.py`` as a script (``python -I``): the package is not on its
    path, so any ``stalwart`` import there kills the monitor at start-up."""
    source = (PACKAGE / "reliability" / "hang" / "monitor.py").read_text()
    assert not [n for n in _imported(ast.parse(source)) if n.split(".")[0] == "stalwart"]
