"""Every package's map (its __init__ docstring) names each of its modules and sub-packages, and
names nothing that is not there: the maps are how a newcomer finds the code."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "rlft"
# A map entry: an indented line starting with a module file or a sub-package folder.
ENTRY = re.compile(r"^\s{2,}([A-Za-z_][A-Za-z0-9_]*\.py|[A-Za-z_][A-Za-z0-9_]*/)\s")


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE_ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)


def present(package: Path) -> set[str]:
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    return modules | subpackages


def mapped(package: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")), clean=False) or ""
    return {m.group(1) for line in doc.splitlines() if (m := ENTRY.match(line))}


def test_the_packages_are_found():
    names = {p.relative_to(PACKAGE_ROOT.parent).as_posix() for p in packages()}
    assert {"rlft", "rlft/config", "rlft/runtime", "rlft/roles", "rlft/engines", "rlft/grpo"} <= names


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.relative_to(PACKAGE_ROOT.parent).as_posix())
def test_the_map_of_each_package_is_current(package):
    listed, there = mapped(package), present(package)
    assert not there - listed, f"{package}: modules missing from the __init__ map: {sorted(there - listed)}"
    assert not listed - there, f"{package}: the __init__ map names modules that do not exist: {sorted(listed - there)}"


def test_a_map_that_misses_a_module_is_caught(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Map:\n\n    a.py   the first\n    gone.py  removed\n"""\n')
    (pkg / "a.py").write_text("")
    (pkg / "b.py").write_text("")
    assert present(pkg) - mapped(pkg) == {"b.py"} and mapped(pkg) - present(pkg) == {"gone.py"}
