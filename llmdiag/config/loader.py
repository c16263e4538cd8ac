"""Typed loading of config sections from TOML data.

Every section is a frozen dataclass whose fields all have defaults, so an
empty file is a valid config. :func:`build` walks the dataclass fields and
the TOML table together: an unknown key is an error that names the key with
its full dotted path (``unknown config key 'balancer.choise_count'``), and a
value of the wrong type names the key and the type it wanted. A section's
``__post_init__`` may raise ``ValueError`` for range checks; the message is
re-raised as :class:`ConfigError` with the section's path.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigError", "build", "read_config_text", "to_data", "to_toml"]

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key."""


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"config key '{path}': no accepted type matches {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{path}' must be a table, got {type(value).__name__}")
        return build(tp, value, path)  # type: ignore[arg-type]
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{path}' must be an array, got {type(value).__name__}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{path}' must be a table, got {type(value).__name__}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{path}' must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{path}' must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{path}' must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{path}' must be a string, got {value!r}")
        return value
    if typing.get_origin(tp) is typing.Literal:
        if value not in args:
            raise ConfigError(f"config key '{path}' must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    raise ConfigError(f"config key '{path}': unsupported type {_describe(tp)}")


def read_config_text(path: Path) -> str:
    """The text of a config file; a missing, unreadable or non-UTF-8 file is a :class:`ConfigError`
    naming it (TOML files are UTF-8 by definition)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "TOML files must be UTF-8"
        ) from None


def build(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Instantiate the dataclass ``cls`` from a TOML table, strictly."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"unknown config key '{where}' (known keys here: {known})")
        kwargs[key] = _convert(value, hints[key], where)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config section '{path or '<root>'}': {exc}") from None


def to_data(obj: Any) -> Any:
    """A config object back to plain TOML-like data: what :meth:`Config.from_data` reads back
    (the config tests' round trip). ``llmdiag config`` prints :func:`to_toml` instead."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_FIELD_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:")


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else json.dumps(name, ensure_ascii=False)


def _scalar(value: Any, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string: the same escapes, \uXXXX for control characters.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v, path) for v in value) + "]"
    raise ConfigError(f"config key '{path}': cannot write {type(value).__name__} as TOML")


def _field_comments(cls: type) -> dict[str, list[str]]:
    """The ``#:`` comments above each field of a config dataclass (its documentation)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (zipapp, frozen): the TOML is still complete
        return {}
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD_LINE.match(line)
        if match and pending:
            comments[match.group(1)] = pending
        pending = []
    return comments


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def _is_table_array(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_table(v) for v in value)


def _emit(obj: Any, path: str, lines: list[str]) -> None:
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init]
        comments = _field_comments(type(obj))
    else:
        items = sorted(obj.items())
        comments = {}
    where = (lambda k: f"{path}.{k}" if path else k)  # noqa: E731
    empty_arrays_of_tables: list[str] = []
    for name, value in items:  # scalars first: after a [table] header they would belong to it
        if _is_table(value) or _is_table_array(value):
            continue
        lines.extend(f"# {c}" for c in comments.get(name, []))
        if value is None:
            lines.append(f"# {_key(name)} = (unset)")
            continue
        if isinstance(value, (list, tuple)) and not value and dataclasses.is_dataclass(obj):
            hint = typing.get_type_hints(type(obj)).get(name)
            item_tp = (typing.get_args(hint) or (None,))[0]
            if dataclasses.is_dataclass(item_tp):  # an empty array of tables, e.g. [[backends]]
                empty_arrays_of_tables.append(where(name))
                continue
        lines.append(f"{_key(name)} = {_scalar(value, where(name))}")
    for name, value in items:
        if _is_table(value):
            lines.append("")
            lines.extend(f"# {c}" for c in comments.get(name, []))
            lines.append(f"[{'.'.join(_key(p) for p in where(name).split('.'))}]")
            _emit(value, where(name), lines)
        elif _is_table_array(value):
            for entry in value:
                lines.append("")
                lines.append(f"[[{'.'.join(_key(p) for p in where(name).split('.'))}]]")
                _emit(entry, where(name), lines)
    for name in empty_arrays_of_tables:
        lines += ["", f"# [[{name}]] tables go here (none by default), e.g.", f"# [[{name}]]"]
        if name == "backends":
            lines.append('# url = "http://127.0.0.1:8000"')


def to_toml(obj: Any) -> str:
    """A config object as a TOML document that :func:`build` reads back to an equal object.

    Field documentation (the ``#:`` comments in the section modules) becomes TOML comments;
    ``None`` values are written as commented-out keys, since TOML has no null."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_toml wants a config dataclass instance, got {type(obj).__name__}")
    lines: list[str] = []
    _emit(obj, "", lines)
    return "\n".join(lines).lstrip("\n") + "\n"
