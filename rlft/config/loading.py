"""Run configuration: one typed schema, loaded from YAML with dotted command-line overrides.

    cfg = load_config("launch/configs/grpo_cpu.yaml", ["optim.lr=2e-6", "grpo.group_size=4"])

Every section is a dataclass with named defaults a person can scan.  Validation turns any
mistake (unknown key, wrong type, value out of range) into a `ConfigError` whose message names
the key path; command-line entry points print that one line and exit with status 2 before
anything is written.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlft.common import say_line
from rlft.config.plugins import load_plugins
from rlft.config.checks import config_warnings, validate
from rlft.config.topology_checks import check_nodes, check_topology
from rlft.config.launchers import LAUNCHERS
from rlft.config.schema import (
    CHECKPOINT_STATE_FILE,
    ConfigError,
    DataConfig,
    GRPOConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    ScheduleConfig,
    SFTConfig,
    TopologyConfig,
    engine_sections,
)
from rlft.engines.vllm_backend import VLLMSettings as VLLMConfig  # vLLM's section, by the name it had here

__all__ = [  # the schema's and the checks' names are re-exported: `from rlft.config import ...` finds all
    "CHECKPOINT_STATE_FILE", "LAUNCHERS", "ConfigError", "DataConfig", "GRPOConfig", "ModelConfig",
    "OptimConfig", "OutputConfig", "RewardConfig", "RunConfig", "SFTConfig", "SamplingConfig", "ScheduleConfig",
    "TopologyConfig", "VLLMConfig", "build_config", "check_nodes", "check_topology", "config_warnings",
    "load_config", "load_config_or_exit", "save_config", "validate",
]


# ---------------------------------------------------------------- building from plain data


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _type_name(tp: Any) -> str:
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp).replace("typing.", "")))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check/convert a YAML value against a dataclass field type; raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if value is None:  # a section whose lines are all commented out
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of settings, got {value!r}")
        return _build(tp, value, path)
    if origin is dict:  # a mapping of free names (e.g. topology.extra_roles: {role: rank})
        key_tp, value_tp = typing.get_args(tp)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {_coerce(k, key_tp, path): _coerce(v, value_tp, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def _sections(cls: type) -> dict[str, type]:
    """The sections a class takes besides its fields: the sampling section's engines' settings."""
    return engine_sections() if cls is SamplingConfig else {}


def _unknown_key(cls: type, key: str, path: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)] + list(_sections(cls))
    where = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f" (did you mean '{(path + '.') if path else ''}{close[0]}'?)" if close else ""
    return ConfigError(f"{where}: unknown key{hint}")


def _build(cls: type, data: dict, path: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    sections = _sections(cls)
    kwargs, extra = {}, {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key in fields:
            kwargs[key] = _coerce(value, hints[key], where)
        elif key in sections:
            extra[key] = _coerce(value, sections[key], where)
        else:
            raise _unknown_key(cls, str(key), path)
    built = cls(**kwargs)
    for key, section in extra.items():
        setattr(built, key, section)
    return built


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. optim.lr=2e-6")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_dotted(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(keys)}: '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def _check_override_path(keys: list[str]) -> Any:
    """Name the exact unknown key of a dotted override before merging; returns the field's type."""
    cls: Any = RunConfig
    done: list[str] = []
    for k in keys:
        if typing.get_origin(cls) is dict:  # one of a mapping's free names
            cls = typing.get_args(cls)[1]
            done.append(k)
            continue
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{'.'.join(done)}: is a value, not a section (cannot set '{'.'.join(keys)}')")
        hints = {**typing.get_type_hints(cls), **_sections(cls)}
        if k not in hints:
            raise _unknown_key(cls, k, ".".join(done))
        cls = hints[k]
        done.append(k)
    return cls


def _is_text_type(tp: Any) -> bool:
    if tp is str:
        return True
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in args and all(
        a in (str, type(None)) for a in args)


# ---------------------------------------------------------------- entry points


def build_config(data: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build and validate a RunConfig from a plain mapping plus `key=value` overrides."""
    data = {} if data is None else dict(data)
    if not isinstance(data, dict):
        raise ConfigError("config: the YAML file must hold a mapping of sections")
    _load_plugins_first(data, overrides)
    for text in overrides:
        keys, value = _parse_override(text)
        tp = _check_override_path(keys)
        raw = text.split("=", 1)[1].strip()
        if _is_text_type(tp) and raw not in ("", "null", "~"):
            value = raw  # YAML would read "no" as false and "010" as 8: text fields keep the text
        _set_dotted(data, keys, value)
    cfg = _build(RunConfig, data)
    cfg.plugins = load_plugins(cfg.plugins)  # before the checks: the plugins' choices become known
    return validate(cfg)


def refuse_repeated(overrides) -> None:
    """ConfigError naming the key and both values when two overrides set one key to different values, or
    a later one sets a whole section an earlier one set a key of: only the last would count, silently.
    The command lines check it (:func:`load_config_or_exit`); a program layering its own overrides over
    defaults (:func:`load_config`) may repeat a key on purpose."""
    given: dict[str, str] = {}
    for text in overrides:
        keys, _ = _parse_override(text)
        key, raw = ".".join(keys), text.split("=", 1)[1].strip()
        if key in given and given[key] != raw:
            raise ConfigError(f"{key}: given twice on the command line, as {given[key]!r} and as {raw!r} (only the "
                              f"last would count): keep one")
        inner = next((k for k in given if k.startswith(key + ".")), None)
        if inner is not None:
            raise ConfigError(f"{key}: given as {raw!r} after {inner}={given[inner]!r}, which it would replace "
                              f"(only the last would count): keep one")
        given[key] = raw


def _load_plugins_first(data: dict, overrides) -> None:
    """Import the config's plugins (the file's, or an override's) before anything is built: the
    engines they register bring their settings sections (`sampling.<name>`)."""
    entries = data.get("plugins")
    for text in overrides:
        keys, value = _parse_override(text)
        if keys == ["plugins"]:
            entries = value
    if entries:
        load_plugins(_coerce(entries, list[str], "plugins"))
class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that holds a key twice (plain YAML keeps the last one,
    so a section written twice silently loses the first one's settings)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise ConfigError(f"{key!r} is written twice, on lines {first} and {line} (the second would "
                                  f"silently replace the first): keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML (or only defaults when `path` is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {p} is not a file")
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except ConfigError as e:
            raise ConfigError(f"config file {p}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p}: cannot be read ({type(e).__name__})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = f": {e.problem}" if getattr(e, "problem", None) else ""
            raise ConfigError(f"config file {p}: not valid YAML{where}{problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    return build_config(data, overrides)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML, atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(p)


def load_config_or_exit(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                        once: bool = True) -> RunConfig:
    """For command-line entry points: one clear line and exit status 2 on any config mistake, a key
    given twice with different values included (``once``; see :func:`refuse_repeated`)."""
    try:
        if once:
            refuse_repeated(overrides)
        return load_config(path, overrides)
    except ConfigError as e:
        say_line(f"rlft: config error: {e}")
        raise SystemExit(2) from None
