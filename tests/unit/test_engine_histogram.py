"""Window quantiles from histogram deltas, checked against hand-computed Prometheus histogram_quantile values."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmdiag.collectors.histogram import CumulativeHistogram, counter_delta, histogram_quantile

INF = math.inf


def test_quantile_interpolates_inside_the_bucket():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]
    # rank 20 of 40 falls in (0.1, 0.5] with 10 below and 20 inside: 0.1 + 0.4 * 10/20
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)
    # rank 39.6: (0.5, 1.0], 30 below, 10 inside: 0.5 + 0.5 * 9.6/10
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.98)
    # first bucket starts at 0: rank 4 -> 0.1 * 4/10
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)


def test_rank_in_the_inf_bucket_returns_the_highest_finite_bound():
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (INF, 10.0)]) == 2.0


def test_no_observations_or_no_inf_bucket_is_na():
    assert histogram_quantile(0.5, [(1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 3.0), (2.0, 5.0)]) is None
    assert histogram_quantile(0.5, [(INF, 5.0)]) is None


def test_non_monotonic_buckets_are_made_monotonic():
    # a torn scrape: 8 then 6; Prometheus treats the 6 as 8
    assert histogram_quantile(0.5, [(1.0, 8.0), (2.0, 6.0), (INF, 10.0)]) == pytest.approx(0.625)


def test_delta_and_reset():
    a = CumulativeHistogram.build([(1.0, 5), (INF, 10)], 10, 12.0)
    b = CumulativeHistogram.build([(1.0, 9), (INF, 20)], 20, 30.0)
    delta, reset = b.delta_since(a)
    assert not reset and delta.buckets == ((1.0, 4), (INF, 10)) and delta.count == 10 and delta.mean() == 1.8
    restarted = CumulativeHistogram.build([(1.0, 1), (INF, 1)], 1, 0.5)
    delta, reset = restarted.delta_since(b)
    assert reset and delta.count == 1 and delta.sum == 0.5
    relayout = CumulativeHistogram.build([(2.0, 30), (INF, 30)], 30, 40.0)
    assert relayout.delta_since(b)[1]  # bucket layout changed: cannot subtract, treat as a reset


def test_counter_delta_never_negative():
    assert counter_delta(10, 15) == (5, False)
    assert counter_delta(10, 3) == (3, True)


bucket_lists = st.lists(
    st.tuples(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), st.floats(min_value=0, max_value=1e9)),
    min_size=0,
    max_size=12,
)


@given(bucket_lists, st.floats(min_value=0, max_value=1e9), st.floats(min_value=0, max_value=1), st.booleans())
def test_quantile_is_na_or_within_the_finite_bounds(pairs, inf_count, q, with_inf):
    buckets = sorted(dict(pairs).items())
    if with_inf:
        buckets.append((INF, max([inf_count] + [c for _, c in buckets])))
    value = histogram_quantile(q, buckets)
    if value is None:
        return
    finite = [le for le, _ in buckets if math.isfinite(le)]
    assert min(min(finite), 0.0) <= value <= max(finite)


def test_an_unchanged_histogram_is_an_empty_window_and_a_lower_sum_still_a_reset():
    h = CumulativeHistogram.build([(0.1, 4.0), (1.0, 8.0), (math.inf, 10.0)], 10.0, 5.0)
    same = CumulativeHistogram.build([(0.1, 4.0), (1.0, 8.0), (math.inf, 10.0)], 10.0, 5.0)
    delta, reset = same.delta_since(h)
    assert not reset and delta.count == 0.0 and delta.sum == 0.0 and delta.mean() is None
    assert delta.buckets == ((0.1, 0.0), (1.0, 0.0), (math.inf, 0.0)) and delta.quantile(0.5) is None
    # Same buckets and count but a smaller sum: the engine restarted and happens to match; a reset.
    lower = CumulativeHistogram.build([(0.1, 4.0), (1.0, 8.0), (math.inf, 10.0)], 10.0, 4.0)
    delta, reset = lower.delta_since(h)
    assert reset and delta.count == 10.0 and delta.sum == 4.0
    no_sum = CumulativeHistogram.build([(0.1, 4.0), (math.inf, 4.0)], None, None)
    delta, reset = no_sum.delta_since(no_sum)
    assert not reset and delta.count == 0.0 and math.isnan(delta.sum)


def _reference_quantiles(qs: tuple[float, ...], buckets: list[tuple[float, float]]) -> tuple[float | None, ...]:
    """histogram_quantiles as first written (a loop and a linear search): what the faster one must give."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return (None,) * len(qs)
    bounds, counts, running = [], [], 0.0
    for le, value in buckets:
        if not math.isfinite(value) or math.isnan(le):
            return (None,) * len(qs)
        running = max(running, value)
        bounds.append(le)
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return (None,) * len(qs)
    out = []
    for q in qs:
        if not 0.0 <= q <= 1.0:
            out.append(None)
            continue
        rank = q * total
        index = next(i for i, c in enumerate(counts) if c >= rank)
        if index == len(bounds) - 1:
            out.append(bounds[-2])
            continue
        upper = bounds[index]
        if index == 0:
            if upper <= 0:
                out.append(upper)
                continue
            lower, below = 0.0, 0.0
        else:
            lower, below = bounds[index - 1], counts[index - 1]
        in_bucket = counts[index] - below
        out.append(upper if in_bucket <= 0 else lower + (upper - lower) * (rank - below) / in_bucket)
    return tuple(out)


def test_quantiles_match_the_reference_on_random_and_odd_bucket_lists() -> None:
    import random

    from llmdiag.collectors.histogram import histogram_quantiles

    rng = random.Random(13)
    qs = (0.0, 0.5, 0.99, 1.0, 1.5)
    cases = [[(0.1, 0.0), (math.inf, 0.0)], [(-1.0, 2.0), (0.5, 1.0), (math.inf, 3.0)],
             [(0.1, -0.0), (1.0, 0.0), (math.inf, 5.0)], [(0.1, math.nan), (math.inf, 1.0)],
             [(math.nan, 1.0), (math.inf, 2.0)], [(0.1, 4.0), (1.0, 2.0), (math.inf, 4.0)]]
    for _ in range(400):
        n = rng.randint(2, 25)
        les = sorted(rng.choice([rng.uniform(-1, 5), round(rng.uniform(0, 3), 1)]) for _ in range(n - 1)) + [math.inf]
        values, running = [], 0.0
        for _ in les:
            running += rng.choice([0.0, 0.0, 1.0, rng.uniform(0, 7)])
            values.append(running if rng.random() > 0.1 else rng.uniform(0, running + 1))  # torn scrapes too
        cases.append(list(zip(les, values, strict=True)))
    for buckets in cases:
        assert repr(histogram_quantiles(qs, buckets)) == repr(_reference_quantiles(qs, buckets)), buckets  # bit for bit
