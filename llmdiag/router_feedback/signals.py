"""Checking what callers feed the balancer: engine signals and other numbers.

A bad value is never a crash and never a made-up number: it is "unknown"
(``None``), counted in ``bad_signal_total`` and logged once per cause.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from llmdiag.model import NA, Distribution

__all__ = ["SignalChecker"]

log = logging.getLogger("llmdiag.router_feedback.balancer")

#: Distinct warnings remembered (so a caller bug cannot grow memory without bound).
_MAX_WARNED = 10_000


class SignalChecker:
    """Turns signal values into floats or ``None``; counts and warns (once per cause) about bad ones."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self._warned: set[str] = set()

    def number(self, value: Any, key: str, name: str) -> float | None:
        """``value`` as a finite float; ``None``/NA/NaN are unknown, anything else bad is counted too."""
        if value is None or value is NA:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            if not (isinstance(value, float) and value != value):
                self.bad_signal(f"{key}:{name}", "update_signals(%s): %s is not a number: %r", name, key, value)
            return None
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float is not a measurement
            number = math.inf
        if not math.isfinite(number):
            self.bad_signal(f"{key}:{name}", "update_signals(%s): %s is not finite: %r", name, key, value)
            return None
        return number

    def ttft(self, value: Any, name: str) -> tuple[float | None, float | None]:
        """The engine's TTFT as ``(ewma, p99)``: a Distribution, a mapping with those keys, or one bare number."""
        if isinstance(value, Distribution):
            ewma, p99 = value.ewma, value.p99
        elif isinstance(value, Mapping):
            ewma, p99 = value.get("ewma"), value.get("p99")
        elif value is None or value is NA:
            return None, None
        else:
            ewma, p99 = value, None  # a bare number: the engine gave one summary value
        return self.number(ewma, "ttft_seconds.ewma", name), self.number(p99, "ttft_seconds.p99", name)

    def bad_signal(self, cause: str, msg: str, *args: Any) -> None:
        self.counters["bad_signal_total"] += 1
        self.warn_once(cause, msg, *args)

    def warn_once(self, cause: str, msg: str, *args: Any) -> None:
        if cause not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(cause)
            log.warning(msg, *args)
