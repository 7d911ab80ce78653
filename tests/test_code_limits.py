"""Size limits of the code: every function of rlft/ fits in 60 lines (from its `def` to its last line)
and every module in 460, so that each can be read at once; measured with ast."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlft"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 460
# Functions over the limit, being split elsewhere: (module path relative to rlft/, qualified name).
ALLOWED: set[tuple[str, str]] = set()


def function_lengths(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines from `def` to its end) of every function and method in `source`."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_measure_counts_a_def_to_its_last_line():
    source = "class A:\n    @staticmethod\n    def f(x):\n        y = x\n\n        return y\n\ndef g():\n    def h():\n        pass\n"
    assert function_lengths(source) == [("A.f", 4), ("g", 3), ("g.h", 2)]


def test_every_function_fits_in_60_lines():
    assert len(modules()) > 100
    long = [f"{path.relative_to(PACKAGE)}: {name} has {lines} lines"
            for path in modules() for name, lines in function_lengths(path.read_text(encoding="utf-8"))
            if lines > MAX_FUNCTION_LINES and (path.relative_to(PACKAGE).as_posix(), name) not in ALLOWED]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_every_module_fits_in_460_lines():
    long = [f"{path.relative_to(PACKAGE)}: {n} lines" for path in modules()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert long == [], f"modules over {MAX_MODULE_LINES} lines (move a coherent part to its own module): {long}"
