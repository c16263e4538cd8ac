"""Cumulative Prometheus histograms, their deltas between scrapes, and quantiles.

Engines export latency histograms as *cumulative* bucket counters since the
engine started. A quantile over those says "since start", which hides a TTFT
that climbed a minute ago under hours of good history. The engine collector
therefore keeps the previous scrape's buckets and works on the **delta**
(what was observed between two scrapes), as Prometheus does with
``histogram_quantile(q, rate(x_bucket[w]))``.

Counter resets: when an engine restarts, its counters start again from zero.
A bucket, ``_count`` or ``_sum`` that went down is a reset; as in Prometheus'
``increase()``, the delta after a reset is the new cumulative value (all of
it was observed since the restart), never a negative number.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable
from itertools import accumulate
from dataclasses import dataclass

__all__ = ["CumulativeHistogram", "HistogramDelta", "counter_delta", "histogram_quantile", "histogram_quantiles"]


def counter_delta(previous: float, current: float) -> tuple[float, bool]:
    """``(increase, reset)`` between two readings of one counter.

    ``current < previous`` means the counter restarted from zero, so the
    increase is ``current`` itself (never negative) and ``reset`` is true.
    """
    if current < previous:
        return max(current, 0.0), True
    return current - previous, False


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    """Observations between two scrapes: bucket upper bounds with cumulative counts, plus count and sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def mean(self) -> float | None:
        if self.count > 0 and math.isfinite(self.sum):
            return self.sum / self.count
        return None

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)

    def median_and_p99(self) -> tuple[float | None, float | None]:
        p50, p99 = histogram_quantiles((0.5, 0.99), self.buckets)
        return p50, p99


@dataclass(frozen=True, slots=True)
class CumulativeHistogram:
    """One histogram as scraped: ``buckets`` maps each upper bound ``le`` to its cumulative count."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @classmethod
    def build(cls, bucket_pairs: Iterable[tuple[float, float]], count: float | None, total: float | None) -> CumulativeHistogram:
        """From ``(le, cumulative count)`` pairs (any order, duplicates summed)."""
        merged: dict[float, float] = {}
        for le, value in bucket_pairs:
            merged[le] = merged.get(le, 0.0) + value
        buckets = tuple(sorted(merged.items()))
        if count is None:
            # No _count line: the +Inf bucket holds the same number.
            count = merged.get(math.inf, 0.0)
        return cls(buckets, float(count), float(total if total is not None else math.nan))

    def delta_since(self, previous: CumulativeHistogram) -> tuple[HistogramDelta, bool]:
        """Observations since ``previous``, and whether a counter reset was seen.

        A reset (count, sum or any bucket went down, or the bucket layout
        changed) makes the whole current histogram the delta.
        """
        if self.buckets == previous.buckets and self.count == previous.count and not self.sum < previous.sum:
            # Nothing observed since (an idle engine's histograms): no reset to look for. ``value -
            # value`` and ``self.sum - previous.sum`` give what the general case gives (0, or NaN
            # for NaN and infinite values).
            return HistogramDelta(tuple((le, value - value) for le, value in self.buckets), 0.0,
                                  self.sum - previous.sum), False
        prev = dict(previous.buckets)
        reset = self.count < previous.count or set(prev) != {le for le, _ in self.buckets}
        if not reset:
            reset = any(value < prev[le] for le, value in self.buckets)
        if not reset and math.isfinite(self.sum) and math.isfinite(previous.sum) and self.sum < previous.sum:
            # Sums can legitimately fall only with negative observations, which latency never has.
            reset = True
        if reset:
            return HistogramDelta(self.buckets, self.count, self.sum), True
        buckets = tuple((le, value - prev[le]) for le, value in self.buckets)
        return HistogramDelta(buckets, self.count - previous.count, self.sum - previous.sum), False


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...] | list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative bucket list, as Prometheus' ``histogram_quantile``.

    ``buckets`` is ``(upper bound, cumulative count)`` sorted by bound and
    must end with ``+Inf``. The quantile is interpolated linearly inside the
    bucket that holds the rank (the lowest bucket's lower bound is 0 when
    its upper bound is positive); a rank in the ``+Inf`` bucket returns the
    highest finite bound. ``None`` (NA) when there are no observations,
    fewer than two buckets or no ``+Inf`` bucket. Counts that are not
    monotonic (a torn scrape) are made monotonic first, as Prometheus does.
    """
    return histogram_quantiles((q,), buckets)[0]


def histogram_quantiles(qs: tuple[float, ...], buckets: tuple[tuple[float, float], ...] | list[tuple[float, float]]) -> tuple[float | None, ...]:
    """:func:`histogram_quantile` for each of ``qs``, the buckets prepared once (p50 and p99 of one window)."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return (None,) * len(qs)
    bounds = [le for le, _ in buckets]
    values = [value for _, value in buckets]
    if not all(map(math.isfinite, values)) or any(map(math.isnan, bounds)):
        return (None,) * len(qs)
    # The running maximum from 0 (max(running, value), in that order, as a loop would).
    counts = list(accumulate(values, max, initial=0.0))[1:]
    total = counts[-1]
    if total <= 0:
        return (None,) * len(qs)
    return tuple(_interpolate(q, bounds, counts, total) if 0.0 <= q <= 1.0 else None for q in qs)


def _interpolate(q: float, bounds: list[float], counts: list[float], total: float) -> float:
    rank = q * total
    index = bisect_left(counts, rank)  # the first bucket whose count reaches the rank (counts never fall)
    if index == len(bounds) - 1:
        return bounds[-2]
    upper = bounds[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[index - 1], counts[index - 1]
    in_bucket = counts[index] - below
    if in_bucket <= 0:
        return upper
    # (rank - below) / in_bucket is at most 1, but the product can round one step past ``upper``
    # (1.9 * 1.9 / 1.9): a quantile never leaves its bucket.
    return min(upper, lower + (upper - lower) * (rank - below) / in_bucket)
