"""GuardedCollector: one collector's failure degrades it, never the agent, and is logged once per cause."""

from __future__ import annotations

import logging

import pytest

from llmdiag.collectors.base import GuardedCollector, collect_snapshot
from llmdiag.model import CollectorState, CollectorStatus, Sample, Scope


class Flaky:
    name = "flaky"

    def __init__(self) -> None:
        self.fail_with: Exception | None = None
        self.closed = False

    def collect(self, now: float) -> list[Sample]:
        if self.fail_with is not None:
            raise self.fail_with
        return [Sample(Scope.HOST, "", "psi_io_full_avg10", 0.5)]

    def status(self) -> CollectorStatus:
        return CollectorStatus(CollectorState.OK)

    def close(self) -> None:
        self.closed = True


class Unavailable(Flaky):
    name = "nogpu"

    def collect(self, now: float) -> list[Sample]:
        return []

    def status(self) -> CollectorStatus:
        return CollectorStatus(CollectorState.UNAVAILABLE, "no driver")


def test_failure_degrades_counts_and_logs_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky()
    guard = GuardedCollector(flaky)
    other = GuardedCollector(Unavailable())
    assert collect_snapshot([guard, other], 10.0).host == {"psi_io_full_avg10": 0.5}
    assert guard.status() == CollectorStatus(CollectorState.OK, None, 10.0, 0)
    flaky.fail_with = OSError("gone")
    with caplog.at_level(logging.WARNING):
        for now in (11.0, 12.0, 13.0):
            snap = collect_snapshot([guard, other], now)
    assert snap.host == {}
    status = snap.collectors["flaky"]
    assert status.status is CollectorState.DEGRADED and "OSError: gone" in (status.reason or "")
    assert status.last_ok_ts == 10.0 and status.errors_total == 3
    assert sum("collector flaky failed" in r.message for r in caplog.records) == 1  # once per cause
    flaky.fail_with = None
    assert collect_snapshot([guard], 14.0).collectors["flaky"].status is CollectorState.OK


def test_unavailable_collector_has_no_last_good_tick() -> None:
    guard = GuardedCollector(Unavailable())
    guard.collect(5.0)
    assert guard.status() == CollectorStatus(CollectorState.UNAVAILABLE, "no driver", None, 0)
    guard.close()
    assert guard.inner.closed  # type: ignore[attr-defined]
