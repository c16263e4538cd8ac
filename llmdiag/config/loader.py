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
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["ConfigError", "build", "to_data"]

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
    """A config object back to plain TOML-like data (for ``--print-config`` and tests)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj
