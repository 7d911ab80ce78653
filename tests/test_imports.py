"""The package's import graph: no module of rlft/ imports itself back through others, counting imports
inside functions and under TYPE_CHECKING too, and the two trainers stay independent of each other."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlft"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the rlft modules it imports anywhere in its text (`from a import b` counts a, and
    a.b when that is a module; importing a submodule also runs its package's __init__)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: "." is this module's package, ".." its parent, ...
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    targets.add(target)
                    parent = target.rpartition(".")[0]
                    while parent:  # importing a.b.c runs a/__init__ and a/b/__init__ first
                        targets.add(parent)
                        parent = parent.rpartition(".")[0]
        targets.discard(name)
        # A package's own __init__ is not imported back by its submodules' "import rlft.x.y".
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "rlft.runtime.context" in graph and "rlft.train_grpo" in graph
    assert cycles(graph) == []
    # Nor between the package's parts (rlft.runtime, rlft.roles, rlft.grpo, ... as wholes).
    parts: dict[str, set[str]] = {}
    for name, targets in graph.items():
        top = ".".join(name.split(".")[:2])
        parts.setdefault(top, set()).update(".".join(t.split(".")[:2]) for t in targets)
    assert cycles({name: targets - {name} for name, targets in parts.items()}) == []


def test_trainers_import_neither_each_other_nor_back_from_the_runtime_or_roles():
    graph = import_graph()
    assert "rlft.train_grpo" not in graph["rlft.train_sft"]
    assert "rlft.train_sft" not in graph["rlft.train_grpo"]
    for name, targets in graph.items():
        if name.startswith(("rlft.roles", "rlft.runtime")):
            assert not {"rlft.train_grpo", "rlft.train_sft"} & targets, name
        if name.startswith("rlft.roles"):
            assert not any(t.startswith("rlft.runtime") for t in targets), name


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
