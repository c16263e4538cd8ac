"""Signal values and their JSON encoding (SPEC section 3.2).

A signal is one named measurement in base units (seconds, bytes, ratios
0..1); counters end in ``_total``. Its value is one of:

* a plain number (``float`` or ``int``);
* ``None``: the source cannot give it (an explicit NA, serialised as
  ``null``); a signal the source never offers is simply absent;
* a :class:`Labelled` value: a mapping from a *label string* to a number.
  The label string is ``key=value`` pairs sorted by key and joined with
  commas, as built by :func:`label_key`
  (``{"code=CANCEL,direction=received": 5}``);
* a :class:`Distribution`: ``p50``, ``p99``, ``ewma`` and ``count`` over the
  collection window (``{"p50": 0.31, "p99": 2.4, "ewma": 0.52, "count": 118}``).

Nothing here invents a zero for "unknown": a quantile that could not be
computed is ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "Distribution",
    "Labelled",
    "SignalValue",
    "Signals",
    "decode_value",
    "encode_value",
    "label_key",
    "parse_label_key",
]

_DISTRIBUTION_KEYS = frozenset({"p50", "p99", "ewma", "count"})


@dataclass(frozen=True, slots=True)
class Distribution:
    """Window summary of a latency-like signal. Any field may be ``None`` (NA)."""

    p50: float | None = None
    p99: float | None = None
    ewma: float | None = None
    count: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return {
            "p50": _finite_or_none(self.p50),
            "p99": _finite_or_none(self.p99),
            "ewma": _finite_or_none(self.ewma),
            "count": _finite_or_none(self.count),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "distribution") -> Distribution:
        return cls(**{k: _number_or_none(obj.get(k), f"{where}.{k}") for k in _DISTRIBUTION_KEYS})


class Labelled(dict[str, float]):
    """A labelled signal: label string (see :func:`label_key`) -> number."""

    def add(self, amount: float, **labels: str) -> None:
        key = label_key(**labels)
        self[key] = self.get(key, 0) + amount

    def total(self) -> float:
        return float(sum(self.values()))


SignalValue = Union[float, int, None, Labelled, Distribution]
Signals = dict[str, SignalValue]


def label_key(**labels: object) -> str:
    """``label_key(direction="received", code="CANCEL")`` -> ``"code=CANCEL,direction=received"``."""
    for k, v in labels.items():
        text = str(v)
        if "," in text or "=" in k or "," in k:
            raise ValueError(f"label {k}={text!r} may not contain ',' (or '=' in the key)")
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def parse_label_key(key: str) -> dict[str, str]:
    """Inverse of :func:`label_key`. The empty string means "no labels"."""
    if not key:
        return {}
    out: dict[str, str] = {}
    for part in key.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"malformed label string {key!r}: {part!r} has no '='")
        out[name] = value
    return out


def _finite_or_none(value: float | None) -> float | None:
    # JSON has no NaN/Inf; an NA (NaN) becomes null rather than invalid JSON.
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number_or_none(value: Any, where: str) -> float | None:
    """A JSON number as a signal value; non-finite or out-of-range numbers are NA (``None``).

    JSON may carry ``1e400`` (inf) or a 400-digit integer: neither is a measurement, and
    either would raise ``OverflowError`` deep inside an analyzer.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number or null, got {value!r}")
    if isinstance(value, int):
        return value if -_INT_LIMIT <= value <= _INT_LIMIT else None
    return value if math.isfinite(value) else None


# Larger integers are not measurements (2**63 bytes is 8 EiB) and do not fit a float exactly.
_INT_LIMIT = 2**63


def encode_value(value: SignalValue) -> Any:
    """Encode one signal value as JSON-ready data (SPEC 3.2)."""
    if isinstance(value, Distribution):
        return value.to_json()
    if isinstance(value, Mapping):
        return {str(k): _finite_or_none(v) for k, v in sorted(value.items())}
    if value is None or isinstance(value, bool):
        if isinstance(value, bool):
            return int(value)
        return None
    if isinstance(value, (int, float)):
        return _finite_or_none(value)
    raise TypeError(f"not a signal value: {value!r}")


def decode_value(obj: Any, where: str = "signal") -> SignalValue:
    """Decode JSON data produced by :func:`encode_value`.

    An object whose keys are all distribution fields (``p50``, ``p99``,
    ``ewma``, ``count``) is a :class:`Distribution`; label strings always
    contain ``=``, so the two cannot be confused.
    """
    if obj is None:
        return None
    if isinstance(obj, bool):
        raise ValueError(f"{where}: booleans are not signal values")
    if isinstance(obj, (int, float)):
        return _number_or_none(obj, where)
    if isinstance(obj, Mapping):
        if obj and set(obj) <= _DISTRIBUTION_KEYS:
            return Distribution.from_json(obj, where)
        out = Labelled()
        for key, v in obj.items():
            parse_label_key(key)  # validates
            num = _number_or_none(v, f"{where}[{key}]")
            out[key] = num  # type: ignore[assignment]
        return out
    raise ValueError(f"{where}: not a signal value: {obj!r}")
