"""bench/soak_agent.py: its arithmetic and its usage errors (the soak itself is a benchmark, not a test)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import soak_agent  # noqa: E402


def test_bucket_quantile_matches_prometheus_histogram_quantile():
    # 100 observations: 50 under 0.01 s, 40 in (0.01, 0.05], 10 in (0.05, 0.1]
    buckets = {0.01: 50.0, 0.05: 90.0, 0.1: 100.0, math.inf: 100.0}
    assert soak_agent.bucket_quantile(0.5, buckets) == pytest.approx(0.01)
    assert soak_agent.bucket_quantile(0.7, buckets) == pytest.approx(0.01 + 0.04 * 20 / 40)
    assert soak_agent.bucket_quantile(0.99, buckets) == pytest.approx(0.05 + 0.05 * 9 / 10)
    assert soak_agent.bucket_quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None  # no ticks in the interval
    assert soak_agent.bucket_quantile(0.99, {0.1: 1.0, math.inf: 5.0}) == 0.1  # beyond the last bucket: its bound


def test_fault_schedule_uses_distinct_engines_and_the_load_cycles():
    engines = [i for i, _text, _start in soak_agent.FAULTS]
    assert len(engines) == len(set(engines)) and max(engines) < 16
    assert soak_agent.load_phase(0) == (1.0, "light")
    assert soak_agent.load_phase(430) == (8.0, "burst")
    assert soak_agent.load_phase(600 + 310) == (4.0, "busy")
    assert [start for _i, _t, start in soak_agent.scaled_faults(0.1)][:2] == [18.0, 33.0]


@pytest.mark.parametrize("argv", [["--duration", "0"], ["--engines", "0"], ["--time-scale", "-1"], ["--bogus"]])
def test_usage_errors_exit_64(argv):
    assert soak_agent.main(argv) == 64
