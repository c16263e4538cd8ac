"""NA: "the source cannot give this value" (after nvitop's ``NaType``).

``NA`` prints as ``N/A``, is falsy, compares unequal to everything but
itself, and behaves as NaN in arithmetic, so callers can compute with values
that may be missing without ``if supported:`` ladders. It serialises as JSON
``null`` (see :func:`llmdiag.model.signals.encode_value`, which turns NaN into
``null``).
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["NA", "NaType", "is_na", "or_none"]


class NaType(float):
    """The NA singleton: a float NaN that prints as ``N/A``."""

    _instance: NaType | None = None

    def __new__(cls) -> NaType:
        if cls._instance is None:
            cls._instance = super().__new__(cls, math.nan)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __format__(self, spec: str) -> str:
        # Keep fill/align/width, drop numeric precision and type ("{:>8.2f}" -> "{:>8}").
        return format("N/A", re.sub(r"[,_]?(\.\d+)?[bcdeEfFgGnosxX%]?$", "", spec))

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return other is self

    def __ne__(self, other: object) -> bool:
        return other is not self

    def __hash__(self) -> int:
        return hash("llmdiag.NA")

    def __reduce__(self) -> str:
        return "NA"


NA = NaType()


def is_na(value: Any) -> bool:
    """True for ``NA``, ``None`` and NaN floats."""
    return value is None or value is NA or (isinstance(value, float) and math.isnan(value))


def or_none(value: Any) -> Any:
    """``None`` for NA/NaN, the value otherwise (for JSON and signal maps)."""
    return None if is_na(value) else value
