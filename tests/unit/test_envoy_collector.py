"""The envoy collector on answers recorded from a real Envoy 1.40 (tests/fixtures/envoy/record.py).

The recording: cluster ``pool`` round-robins 12 requests over ``good`` (3 x 200),
``bad`` (4 x 500), ``stall`` (3 x 504 after the route timeout) and ``dead``
(3 refused connects, Envoy's 503); cluster ``solo`` is one engine killed while a
stream was open.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmdiag.agent.wiring import COLLECTOR_FACTORIES, CollectorUnavailable
from llmdiag.collectors.envoy_admin import EnvoyAdminCollector, parse_clusters, parse_stats
from llmdiag.collectors.http_fetch import FetchResult
from llmdiag.config import Config
from llmdiag.config.picker import EnvoyConfig
from llmdiag.model import Backend, CollectorState, Scope, Snapshot

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "envoy"
CLUSTERS = (FIXTURES / "clusters.json").read_text()
STATS = (FIXTURES / "stats.txt").read_text()
PORTS = {"good": 49559, "bad": 58281, "stall": 34207, "dead": 49611, "solo": 50431}
BACKENDS = [Backend.from_url(f"http://127.0.0.1:{p}", name=n) for n, p in PORTS.items() if n != "dead"]


def fetcher(clusters: str | None = CLUSTERS, stats: str | None = STATS, calls: list[str] | None = None):
    def fetch(url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        if calls is not None:
            calls.append(url)
        body = clusters if "/clusters" in url else stats
        if body is None:
            return FetchResult(url, error="connection refused")
        return FetchResult(url, status=200, body=body)
    return fetch


def snapshot(collector: EnvoyAdminCollector) -> Snapshot:
    snap = Snapshot(ts=1.0, hostname="gw")
    snap.extend(collector.collect(1.0))
    return snap


def test_per_backend_classes_from_the_host_counters():
    calls: list[str] = []
    collector = EnvoyAdminCollector(EnvoyConfig(admin_url="http://127.0.0.1:9901"), BACKENDS, fetcher(calls=calls))
    snap = snapshot(collector)
    assert calls == ["http://127.0.0.1:9901/clusters?format=json", "http://127.0.0.1:9901/stats?filter=%5Ecluster%5C."]
    responses = {n: dict(snap.backends[n]["gateway_responses_total"]) for n in ("good", "bad", "stall", "solo")}
    assert responses["good"] == {"class=ok": 3, "class=server_5xx": 0, "class=timeout": 0, "class=connect_error": 0}
    assert responses["bad"]["class=server_5xx"] == 4 and responses["bad"]["class=ok"] == 0
    assert responses["stall"]["class=timeout"] == 3 and responses["stall"]["class=server_5xx"] == 0
    # The refused port is no configured backend: it is reported per destination.
    dead = snap.destinations[f"127.0.0.1:{PORTS['dead']}"]["gateway_responses_total"]
    assert dead["class=connect_error"] == 3 and dead["class=server_5xx"] == 0
    assert snap.backends["good"]["gateway_connections_active"] == 1
    assert snap.backends["stall"]["gateway_connections_total"] == 3
    assert snap.backends["bad"]["gateway_outlier_ejected"] == 0
    assert collector.status().status is CollectorState.OK


def test_resets_per_cluster_and_for_single_host_clusters():
    snap = snapshot(EnvoyAdminCollector(EnvoyConfig(admin_url="http://e:1"), BACKENDS, fetcher()))
    # The engine killed mid-stream: a remote reset on its one-host cluster.
    assert dict(snap.backends["solo"]["gateway_upstream_resets_total"]) == {"direction=local": 0, "direction=remote": 1}
    # Pool resets (Envoy closing the stalled engine's connections at the timeout) are per cluster only.
    assert "gateway_upstream_resets_total" not in snap.backends["stall"]
    host = snap.host["gateway_upstream_resets_total"]
    assert host["cluster=pool,direction=local"] == 3 and host["cluster=solo,direction=remote"] == 1


def test_cluster_filter_and_parsers():
    clusters = parse_clusters(json.loads(CLUSTERS), ["solo"])
    assert list(clusters) == ["solo"]
    assert parse_stats("cluster.a.b.upstream_rq_rx_reset: 2\ncluster.a.b.upstream_rq_total: 9\nnoise\n") == {
        "a.b": {"remote": 2.0, "local": 0.0}}
    # Malformed parts are skipped, not raised.
    assert parse_clusters({"cluster_statuses": [7, {"name": "x", "host_statuses": [None, {"address": {}}]}]}) == {"x": {}}
    assert parse_clusters({"cluster_statuses": "no"}) == {}


def test_admin_unreachable_or_not_envoy_is_degraded_with_no_made_up_values():
    collector = EnvoyAdminCollector(EnvoyConfig(admin_url="http://e:1"), BACKENDS, fetcher(clusters=None))
    assert collector.collect(1.0) == []
    status = collector.status()
    assert status.status is CollectorState.DEGRADED and "connection refused" in status.reason
    collector = EnvoyAdminCollector(EnvoyConfig(admin_url="http://e:1"), BACKENDS, fetcher(clusters="<html>"))
    assert collector.collect(1.0) == [] and "not JSON" in collector.status().reason
    collector = EnvoyAdminCollector(EnvoyConfig(admin_url="http://e:1"), BACKENDS, fetcher(clusters='{"a": 1}'))
    assert collector.collect(1.0) == [] and "cluster_statuses" in collector.status().reason
    # /stats failing: host counters still come, resets are absent (not zero), status says why.
    collector = EnvoyAdminCollector(EnvoyConfig(admin_url="http://e:1"), BACKENDS, fetcher(stats=None))
    samples = collector.collect(1.0)
    assert samples and not any(s.name == "gateway_upstream_resets_total" for s in samples)
    assert collector.status().status is CollectorState.DEGRADED
    assert all(s.scope in (Scope.BACKEND, Scope.DESTINATION) for s in samples)


def test_wiring_and_config():
    with pytest.raises(CollectorUnavailable, match="admin_url"):
        COLLECTOR_FACTORIES["envoy"](Config(), BACKENDS)
    config = Config.from_toml('[envoy]\nadmin_url = "http://127.0.0.1:9901"\nclusters = ["pool"]\n')
    collector = COLLECTOR_FACTORIES["envoy"](config, BACKENDS)
    assert collector.name == "envoy" and collector.config.clusters == ("pool",)
    with pytest.raises(ValueError, match="envoy.admin_url"):
        Config.from_toml('[envoy]\nadmin_url = "127.0.0.1:9901"\n')


class _SlowAdmin:
    """An admin API on a fake clock: each read takes ``took[path]`` seconds, or hangs (None) until
    the timeout it was given runs out; records the timeouts it was given."""

    def __init__(self, took: dict[str, float | None]) -> None:
        self.now = 0.0
        self.took = took
        self.timeouts: list[tuple[str, float]] = []

    def fetch(self, url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        path = "/clusters" if "/clusters" in url else "/stats"
        self.timeouts.append((path, timeout))
        took = self.took[path]
        if took is None or took > timeout:
            self.now += timeout
            return FetchResult(url, error=f"timed out after {timeout:g} s", failure="timeout")
        self.now += took
        return FetchResult(url, status=200, body=CLUSTERS if path == "/clusters" else STATS)


@pytest.mark.parametrize("took, reads, resets", [
    ({"/clusters": None, "/stats": 0.01}, [("/clusters", 0.8)], False),  # hung: one read, cut at the deadline
    ({"/clusters": 0.5, "/stats": None}, [("/clusters", 0.8), ("/stats", 0.3)], False),  # /stats gets what is left
    ({"/clusters": 0.8, "/stats": 0.01}, [("/clusters", 0.8)], False),  # nothing left: /stats waits a tick
    ({"/clusters": 0.1, "/stats": 0.1}, [("/clusters", 0.8), ("/stats", 0.7)], True),
])
def test_both_admin_reads_end_within_the_ticks_share(took, reads, resets):
    # [agent] interval_seconds = 1: the two reads have 0.8 s together, though each may take 1 s.
    admin = _SlowAdmin(took)
    config = Config.from_toml('[envoy]\nadmin_url = "http://127.0.0.1:9901"\n')
    collector = COLLECTOR_FACTORIES["envoy"](config, BACKENDS)
    collector._fetch, collector._monotonic = admin.fetch, lambda: admin.now
    samples = collector.collect(1.0)
    assert [(path, round(t, 6)) for path, t in admin.timeouts] == reads
    assert admin.now <= 0.8 + 1e-9
    assert any(s.name == "gateway_upstream_resets_total" for s in samples) is resets
    if took["/clusters"] is not None:
        assert any(s.name == "gateway_responses_total" for s in samples)  # what was read is kept
    status = collector.status()
    assert (status.status is CollectorState.OK) is resets
    if reads == [("/clusters", 0.8)] and took["/clusters"] is not None:
        assert "no time left" in status.reason


def test_a_hung_admin_port_is_cut_at_the_ticks_share():
    # A real listener that accepts and never answers, read with the real http_get.
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        config = Config.from_toml(f'[agent]\ninterval_seconds = 0.5\n[envoy]\nadmin_url = "http://127.0.0.1:{srv.getsockname()[1]}"\n')
        collector = COLLECTOR_FACTORIES["envoy"](config, BACKENDS)
        assert collector.collect(1.0) == []
    assert "timed out after 0.4 s" in collector.status().reason
