"""Rolling windows: one bounded ring of ``(ts, value)`` points per signal.

A :class:`WindowStore` keeps, per series key (a backend, GPU, destination or
host plus a signal name; see :func:`series_key`), the points of the last
``window_seconds``. Memory is bounded twice: points older than the window are
dropped, each series holds at most ``max_points`` points, and series not
updated for a whole window are forgotten (labels such as pids come and go).

Points are C doubles (``array('d')``, 16 bytes a point) rather than lists of
Python floats (8 bytes a slot plus a 24-byte float object per value): an agent
with 16 backends keeps ~1,500 series of ~300 points, and that difference was
most of its memory growth over the first minutes. A double holds a Python
float exactly, so every value read back is the one appended.

Counters (names ending in ``_total``) are stored *reset-adjusted*: when a raw
value is below the previous one the process restarted and the counter began
again from zero, so the increase is the new raw value itself, never a
negative delta. Rates and increases computed from the store are therefore
never negative, and a restart costs at most one tick of under-counting.

A scrape gap simply leaves no points; a rate over a window that spans the gap
is the average over the real time between the points it uses.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Iterator

__all__ = ["Series", "WindowStore", "is_counter", "series_key"]

#: Dropped points a series may hold before they are cut off its arrays (one memmove of the live
#: points, every this many ticks): small, so a series holds little more than its window.
_SLACK_POINTS = 32


def is_counter(signal: str) -> bool:
    """Counters end in ``_total`` (SPEC 3.2); a labelled counter keeps the suffix before its ``{labels}``."""
    return signal.partition("{")[0].endswith("_total")


def series_key(scope: str, subject: str, signal: str) -> str:
    """``series_key("b", "vllm-0", "kv_cache_usage")`` -> ``"b/vllm-0/kv_cache_usage"``.

    Scopes: ``h`` host, ``d`` destination, ``b`` backend, ``e`` DP engine
    (subject ``backend/engine``), ``g`` GPU.
    """
    return f"{scope}/{subject}/{signal}"


class Series:
    """Points of one signal, oldest first; counters reset-adjusted."""

    __slots__ = ("ts", "values", "start", "counter", "_raw_last", "_adjusted")

    def __init__(self, counter: bool) -> None:
        self.ts = array("d")
        self.values = array("d")
        self.start = 0  # index of the oldest live point; the prefix is garbage, compacted in bulk
        self.counter = counter
        self._raw_last: float | None = None
        self._adjusted = 0.0

    def append(self, ts: float, raw: float) -> None:
        times = self.ts
        if times and ts <= times[-1]:
            return  # out of order or duplicate tick: the window is monotonic
        value = raw
        if self.counter:
            if self._raw_last is None:
                self._adjusted = raw
            elif raw >= self._raw_last:
                self._adjusted += raw - self._raw_last
            else:
                # Counter reset (process restart): it counted up from 0 to `raw` since.
                self._adjusted += raw
            self._raw_last = raw
            value = self._adjusted
        times.append(ts)
        self.values.append(value)

    def trim(self, oldest: float, max_points: int) -> None:
        ts = self.ts
        start = self.start
        n = len(ts)
        # Keep one point at or before `oldest` so a full-window lookback still has an anchor.
        while start + 1 < n and ts[start + 1] <= oldest:
            start += 1
        if n - start > max_points:
            start = n - max_points
        if start > _SLACK_POINTS:
            del ts[:start]
            del self.values[:start]
            start = 0
        self.start = start

    def __len__(self) -> int:
        return len(self.ts) - self.start

    @property
    def last_ts(self) -> float | None:
        return self.ts[-1] if len(self.ts) > self.start else None

    def latest(self) -> float | None:
        return self.values[-1] if len(self.ts) > self.start else None

    def index_at(self, ts: float) -> int | None:
        """Index of the last point at or before ``ts``, or ``None``."""
        i = bisect_right(self.ts, ts, self.start) - 1
        return i if i >= self.start else None

    def at(self, ts: float) -> float | None:
        i = self.index_at(ts)
        return None if i is None else self.values[i]

    def points_since(self, ts: float) -> Iterator[tuple[float, float]]:
        i = bisect_right(self.ts, ts, self.start)
        # Include points at exactly `ts`.
        while i > self.start and self.ts[i - 1] >= ts:
            i -= 1
        yield from zip(self.ts[i:], self.values[i:])  # array slices: copies in C, no index per point


class WindowStore:
    """All series of one analyzer (see module docstring)."""

    def __init__(self, window_seconds: float, max_points: int = 4096) -> None:
        self.window_seconds = window_seconds
        self.max_points = max_points
        self._series: dict[str, Series] = {}
        self._now = -math.inf
        self._last_sweep = -math.inf
        #: How many sweeps have forgotten series: a caller that keeps :class:`Series` objects
        #: (:meth:`series_for`) drops them when this changes.
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self._series)

    def append(self, key: str, ts: float, value: float) -> None:
        self.series_for(key).append(ts, value)

    def series_for(self, key: str) -> Series:
        """The series of ``key``, created empty if there is none. It stays this store's series
        until a sweep forgets it (see :attr:`sweeps`)."""
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = Series(is_counter(key))
        return series

    def advance(self, now: float) -> None:
        """Trim every series to the window; forget series idle for a whole window."""
        self._now = now
        oldest = now - self.window_seconds
        max_points = self.max_points
        for series in self._series.values():
            # Series.trim's own first test, inlined: most series (one point a tick) have nothing
            # or one point to drop, and a call per series per tick is most of this loop's cost.
            ts, start = series.ts, series.start
            n = len(ts)
            if (start + 1 < n and ts[start + 1] <= oldest) or n - start > max_points:
                series.trim(oldest, max_points)
        if now - self._last_sweep >= self.window_seconds:
            self._last_sweep = now
            idle = [k for k, s in self._series.items() if s.last_ts is None or s.last_ts < oldest]
            for k in idle:
                del self._series[k]
            if idle:
                self.sweeps += 1

    def series(self, key: str) -> Series | None:
        return self._series.get(key)

    def latest(self, key: str, max_age: float | None = None) -> float | None:
        s = self._series.get(key)
        if s is None or s.last_ts is None:
            return None
        if max_age is not None and self._now - s.last_ts > max_age:
            return None
        return s.latest()

    def value_ago(self, key: str, seconds: float) -> float | None:
        """The value at ``now - seconds`` (the last point at or before it)."""
        s = self._series.get(key)
        return None if s is None else s.at(self._now - seconds)

    def increase(self, key: str, seconds: float) -> float | None:
        """How much a counter rose over the last ``seconds`` (reset-adjusted, >= 0).

        Over a window longer than the history, the increase since the oldest
        point; ``None`` with fewer than two points.
        """
        span = self._span(key, seconds)
        return None if span is None else span[1]

    def rate(self, key: str, seconds: float) -> float | None:
        """Per-second rate of a counter over the last ``seconds`` (>= 0), ``None`` without two points."""
        span = self._span(key, seconds)
        if span is None or span[0] <= 0:
            return None
        return span[1] / span[0]

    def _span(self, key: str, seconds: float) -> tuple[float, float] | None:
        s = self._series.get(key)
        if s is None:
            return None
        # len(s) and s.index_at(), inlined: rules ask for a few hundred rates and increases a tick.
        ts, start = s.ts, s.start
        last = len(ts) - 1
        if last - start < 1:
            return None
        oldest = self._now - seconds
        i = bisect_right(ts, oldest, start) - 1
        if i < start:
            i = start
        if i >= last:
            # The newest point is older than the window start: nothing moved in the window.
            return (seconds, 0.0) if ts[last] <= oldest else None
        values = s.values
        return ts[last] - ts[i], max(0.0, values[last] - values[i])

    def increments(self, key: str, seconds: float) -> list[tuple[float, float]]:
        """``(ts, amount)`` for every tick in the window where a counter rose (for correlation)."""
        s = self._series.get(key)
        if s is None:
            return []
        out = []
        i = s.index_at(self._now - seconds)
        lo = s.start if i is None else i
        values = s.values
        if lo >= len(values):
            return out
        prev = values[lo]
        for t, v in zip(s.ts[lo + 1:], values[lo + 1:]):  # array slices: no index per point
            if v > prev:
                out.append((t, v - prev))
            prev = v
        return out
