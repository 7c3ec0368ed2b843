"""The architecture rules of docs/architecture.md, checked on the source (AST scan of the package).

1. No function over ~60 lines (the loop reads on one screen).
2. The components never import the trainer, the CLI or its run config: any user's loop can
   compose them. Imports inside ``if TYPE_CHECKING:`` and inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stalwart"
MAX_FUNCTION_LINES = 60
COMPONENTS = (
    "reliability",
    "observability",
    "graphs",
    "checkpoint",
    "data",
    "models",
    "distributed",
    "loop",
    "integrations",
)
FORBIDDEN = ("stalwart.train", "stalwart.cli", "stalwart.config.run")
# module (relative to the package) -> why it may still import the trainer side. Keep it short.
IMPORT_EXCEPTIONS: dict[str, str] = {}
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


def test_the_report_reader_and_renderer_do_not_import_each_other() -> None:
    """``report.run_report`` loads, ``report.html`` renders; both use ``run_dir``'s vocabulary."""
    for name in ("html", "plotly_charts", "svg"):
        imported = _imported(ast.parse((PACKAGE / "report" / f"{name}.py").read_text()))
        assert "stalwart.report.run_report" not in imported, name
        assert "stalwart.report" not in imported, name
    html = _imported(ast.parse((PACKAGE / "report" / "html.py").read_text()))
    assert "stalwart.observability.run_dir" in html
