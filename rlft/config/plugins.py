"""`plugins:` the user's own modules, imported when a config is loaded, before it is checked.

A plugin registers its choices the way rlft registers its own — a loss (`register_policy_loss`), an
answer format (`register_answer_format`), a rollout engine, a role, a mode — so the config accepts their
names, on every rank and in the launch's checks before any rank starts, with no file of rlft edited:

    plugins: [my_project.rl_choices, ./plugins/my_loss.py]

An entry is a module name (importable from PYTHONPATH or installed) or the path of a `.py` file
(relative to the directory the launch runs in).  A module is imported once per process however many
configs name it.  An entry that cannot be imported, or whose import does not finish within
:data:`PLUGIN_IMPORT_TIMEOUT_S`, is one config error naming it and the cause.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

from rlft.alarm import DeadlinePassed, deadline
from rlft.config.schema import ConfigError

# Seconds a plugin's import may take (a module that waits on a lock or a network at import would
# otherwise hold the launch, and every rank, at its start).
PLUGIN_IMPORT_TIMEOUT_S = 120.0

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_plugins(entries: list[str]) -> list[str]:
    """Import every entry (see the module's doc); returns the entries as the resolved config records
    them (files as absolute paths, so every rank finds the same file)."""
    resolved = []
    for i, entry in enumerate(entries):
        where = f"plugins[{i}]"
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(f"{where}: expected a module name or a .py file, got {entry!r}")
        entry = entry.strip()
        if entry.endswith(".py") or "/" in entry:
            resolved.append(_import_file(Path(entry).expanduser(), where))
        elif _MODULE_NAME.match(entry):
            _import_module(entry, where)
            resolved.append(entry)
        else:
            raise ConfigError(f"{where}: {entry!r} is neither a module name (a.b.c) nor a .py file")
    return resolved


def _import_module(name: str, where: str) -> None:
    try:
        with deadline(PLUGIN_IMPORT_TIMEOUT_S, ""):
            importlib.import_module(name)
    except DeadlinePassed:
        raise ConfigError(f"{where}: importing {name} did not finish within {PLUGIN_IMPORT_TIMEOUT_S:g} s") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {name}: {e}") from None
    except ModuleNotFoundError as e:
        hint = " (is its folder on PYTHONPATH?)" if e.name == name.split(".")[0] else ""
        raise ConfigError(f"{where}: cannot import {name}: {type(e).__name__}: {e}{hint}") from None
    except Exception as e:  # the plugin's own error, at import: one line, not its traceback
        raise ConfigError(f"{where}: importing {name} failed: {type(e).__name__}: {e}") from None


def _import_file(path: Path, where: str) -> str:
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file")
    name = "rlft_plugin_" + re.sub(r"\W", "_", str(path))
    if name in sys.modules:  # already imported by this process (a config loaded twice)
        return str(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with deadline(PLUGIN_IMPORT_TIMEOUT_S, ""):
            spec.loader.exec_module(module)
    except DeadlinePassed:
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {path} did not finish within {PLUGIN_IMPORT_TIMEOUT_S:g} s") from None
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from None
    return str(path)
