"""Per-backend baselines: "far above its own baseline" needs one.

A baseline is a slow, time-weighted EWMA per key: after a step ``dt`` the
weight of the new value is ``1 - exp(-dt / tau)`` with ``tau`` =
``baseline_seconds``, so a scrape gap weighs what it lasted and the tick
rate does not change the time constant. It is *trusted* only after
``warmup_seconds`` of observations.

Baselines are frozen while a diagnosis is open (or about to open) on their
subject: :meth:`Baselines.update` is simply not called for a frozen subject,
so an hour of overload never becomes the new normal.
"""

from __future__ import annotations

import math

__all__ = ["Baselines"]


class _Ewma:
    __slots__ = ("value", "first_ts", "last_ts")

    def __init__(self, ts: float, value: float) -> None:
        self.value = value
        self.first_ts = ts
        self.last_ts = ts


class Baselines:
    def __init__(self, tau_seconds: float, warmup_seconds: float) -> None:
        self.tau_seconds = tau_seconds
        self.warmup_seconds = warmup_seconds
        self._state: dict[str, _Ewma] = {}

    def update(self, key: str, ts: float, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        st = self._state.get(key)
        if st is None:
            self._state[key] = _Ewma(ts, value)
            return
        dt = ts - st.last_ts
        if dt <= 0:
            return
        weight = 1.0 - math.exp(-dt / self.tau_seconds)
        st.value += weight * (value - st.value)
        st.last_ts = ts

    def get(self, key: str) -> float | None:
        """The baseline, or ``None`` while it is still warming up."""
        st = self._state.get(key)
        if st is None or st.last_ts - st.first_ts < self.warmup_seconds:
            return None
        return st.value

    def prune(self, older_than: float) -> None:
        """Forget baselines not updated since ``older_than`` (backends that went away)."""
        for key in [k for k, st in self._state.items() if st.last_ts < older_than]:
            del self._state[key]

    def forget(self, prefix: str) -> None:
        for key in [k for k in self._state if k.startswith(prefix)]:
            del self._state[key]

    def __len__(self) -> int:
        return len(self._state)
