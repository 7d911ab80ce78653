"""rlft/common.py's import_object: the object a "module:attribute" setting names, and the one-line
messages that say which setting, which spec and what went wrong."""
from __future__ import annotations

import json
import sys

import pytest

from rlft.common import import_object

MODULE = """
NOT_CALLABLE = 3


def one(row):
    return row


def two(a, b):
    return a, b


class Outer:
    class Inner:
        pass

    @staticmethod
    def method(row):
        return row
"""


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Writes modules into a folder on sys.path; each test's names are its own (no cached imports)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_the_object_is_imported_dotted_names_too(modules):
    m = modules("rlft_test_common_good", MODULE)
    assert import_object(f"{m}:one", "data.adapter")({"a": 1}) == {"a": 1}
    assert import_object(f" {m}:Outer.method ", "data.adapter").__name__ == "method"
    assert import_object(f"{m}:Outer.Inner", "environment").__name__ == "Inner"
    assert import_object("json:dumps", "reward function") is json.dumps
    assert import_object(f"{m}:NOT_CALLABLE", "setting", require_callable=False) == 3


@pytest.mark.parametrize("spec", ["json", "json:", ":dumps", "json:dumps:x", "my-module:f", "json: dumps", "", None, 3])
def test_a_spec_of_the_wrong_form(spec):
    with pytest.raises(ValueError) as err:
        import_object(spec, "reward function")
    assert str(err.value) == f"reward function {spec!r}: expected 'package.module:function'"
    with pytest.raises(ValueError) as err:
        import_object(spec, "environment", form="module:Class")
    assert str(err.value) == f"environment {spec!r}: expected 'module:Class'"


def test_a_module_that_is_not_there():
    with pytest.raises(ValueError) as err:
        import_object("rlft_no_such_module_xyz.sub:f", "data.adapter")
    assert str(err.value) == ("data.adapter 'rlft_no_such_module_xyz.sub:f': cannot import module "
                              "'rlft_no_such_module_xyz.sub' (ModuleNotFoundError: No module named "
                              "'rlft_no_such_module_xyz')")


def test_a_module_whose_own_imports_are_missing(modules):
    m = modules("rlft_test_common_needs", "import rlft_no_such_dependency_xyz\n")
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:f", "reward function")
    assert str(err.value) == (f"reward function '{m}:f': cannot import module '{m}' (ModuleNotFoundError: "
                              "No module named 'rlft_no_such_dependency_xyz')")


@pytest.mark.parametrize("name, source, cause", [
    ("raises", "raise RuntimeError('no backend here\\n  second line')\n", "RuntimeError: no backend here second line"),
    ("exits", "raise SystemExit(2)\n", "SystemExit: 2"),
    ("syntax", "def broken(:\n    pass\n", "SyntaxError: "),
])
def test_a_module_whose_code_fails_while_importing(modules, name, source, cause):
    m = modules(f"rlft_test_common_fails_{name}", source)
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:f", "environment", form="module:Class")
    message = str(err.value)
    assert message.startswith(f"environment '{m}:f': importing module '{m}' failed ({cause}"), message
    assert "\n" not in message and err.value.__cause__ is not None


def test_a_missing_attribute_names_where_it_was_looked_for(modules):
    m = modules("rlft_test_common_attrs", MODULE)
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:missing", "reward function")
    assert str(err.value) == f"reward function '{m}:missing': module '{m}' has no attribute 'missing'"
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:Outer.Inner.gone", "environment")
    assert str(err.value) == f"environment '{m}:Outer.Inner.gone': 'Outer.Inner' has no attribute 'gone'"


def test_an_object_that_is_not_callable(modules):
    m = modules("rlft_test_common_value", MODULE)
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:NOT_CALLABLE", "reward function")
    assert str(err.value) == f"reward function '{m}:NOT_CALLABLE' is not callable (it is a int)"


def test_a_function_that_cannot_take_the_arguments(modules):
    m = modules("rlft_test_common_args", MODULE)
    row = ({"question": "q"},)
    assert import_object(f"{m}:one", "data.adapter", call_with=row, takes="one argument").__name__ == "one"
    with pytest.raises(ValueError) as err:
        import_object(f"{m}:two", "data.adapter", call_with=row, takes="one argument, the row (a dict)")
    assert str(err.value) == (f"data.adapter '{m}:two' must accept one argument, the row (a dict); "
                              "its signature is (a, b)")
    assert import_object("builtins:max", "reward function", call_with=("a", "b"), takes="two") is max


def test_the_error_class_is_the_callers(modules):
    class SpecError(ValueError):
        pass

    with pytest.raises(SpecError, match=r"^environment 'json:nothing': module 'json' has no attribute 'nothing'$"):
        import_object("json:nothing", "environment", error=SpecError)
