"""Gateway side: what a running Envoy knows about each backend, from its admin API.

Envoy sees every request it proxies: per upstream host it counts successes,
errors, timeouts and failed connects, and per cluster the resets. The
``envoy`` collector polls ``GET {admin}/clusters?format=json`` (per-host
counters) and ``GET {admin}/stats?filter=^cluster\\.`` (per-cluster counters)
once per tick and turns them into signals:

Per backend (a host whose ``ip:port`` is a configured backend's address;
other hosts, e.g. those an ``ORIGINAL_DST`` cluster learned, are reported per
destination ``ip:port``), summed over the clusters that hold it:

- ``gateway_responses_total{class}``, the SPEC 3.2 ``responses_total`` classes as the proxy saw them
  (a separate name: the engine collector's ``responses_total`` is the engine's own count, and a
  refused connection or a hung engine shows only here):
  ``ok`` = ``rq_success``; ``timeout`` = ``rq_timeout``; ``connect_error`` =
  ``cx_connect_fail``; ``server_5xx`` = ``rq_error - rq_timeout -
  cx_connect_fail`` (Envoy's ``rq_error`` counts 5xx answers, timeouts and
  failed connects together, measured with Envoy 1.40; with retries the split
  is approximate). Envoy does not tell a saturation 429 from a client quota, so
  those classes are not given;
- ``gateway_connections_active``, ``gateway_requests_active`` (gauges),
  ``gateway_connections_total``;
- ``gateway_outlier_ejected``: 1 while Envoy's outlier detection has ejected the host;
- ``gateway_upstream_resets_total{direction}`` only for a backend that is the
  only host of its cluster: Envoy counts resets per cluster, not per host.
  ``remote`` = ``upstream_rq_rx_reset + upstream_cx_destroy_remote_with_active_rq``
  (the engine reset or closed a connection with a request on it, e.g. it
  crashed mid-stream); ``local`` = ``upstream_rq_tx_reset +
  upstream_cx_destroy_local_with_active_rq`` (Envoy gave up: timeouts, the
  client went away).

Per host (this machine), for every cluster: ``gateway_upstream_resets_total{cluster,direction}``
as above, so resets in a multi-host pool are still visible.

Envoy sends counter values as strings and omits the value of a zero counter
(the 1.40 JSON); a host without a value reads 0, a host Envoy does not list
gives no signal at all. Envoy restarting resets its counters to zero; the
analyzers treat a falling counter as a restart.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from llmdiag.collectors.http_fetch import SCRAPE_SHARE_OF_TICK, FetchFunction, http_get
from llmdiag.config import Config
from llmdiag.config.picker import EnvoyConfig
from llmdiag.model import Backend, CollectorState, CollectorStatus, Sample, Scope
from llmdiag.model.signals import Labelled

__all__ = ["EnvoyAdminCollector", "build_envoy_collector", "parse_clusters", "parse_stats"]

log = logging.getLogger("llmdiag.collectors.envoy")

_MIN_READ_SECONDS = 0.01  # less than this left of the deadline: the read is not started

_HOST_COUNTERS = ("rq_success", "rq_error", "rq_timeout", "cx_connect_fail", "cx_total", "rq_total")
_HOST_GAUGES = ("cx_active", "rq_active")
_RESET_STATS = {
    "upstream_rq_rx_reset": "remote",
    "upstream_cx_destroy_remote_with_active_rq": "remote",
    "upstream_rq_tx_reset": "local",
    "upstream_cx_destroy_local_with_active_rq": "local",
}


def _number(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if number == number and number >= 0 else 0.0


def parse_clusters(doc: Mapping[str, Any], wanted: Iterable[str] = ()) -> dict[str, dict[str, dict[str, float]]]:
    """``/clusters?format=json`` -> cluster -> host ``ip:port`` -> stat name -> value (0 when Envoy omits it).

    Health flags become ``outlier_ejected`` (0/1). Malformed parts are skipped, never raised.
    """
    only = set(wanted)
    out: dict[str, dict[str, dict[str, float]]] = {}
    statuses = doc.get("cluster_statuses") if isinstance(doc, Mapping) else None
    for cluster in statuses if isinstance(statuses, list) else ():
        if not isinstance(cluster, Mapping) or not isinstance(cluster.get("name"), str):
            continue
        name = cluster["name"]
        if only and name not in only:
            continue
        hosts: dict[str, dict[str, float]] = {}
        for host in cluster.get("host_statuses") or ():
            if not isinstance(host, Mapping):
                continue
            sock = (host.get("address") or {}).get("socket_address") if isinstance(host.get("address"), Mapping) else None
            if not isinstance(sock, Mapping) or "address" not in sock or "port_value" not in sock:
                continue  # pipes and internal addresses: not an engine
            ip = str(sock["address"])
            address = f"[{ip}]:{sock['port_value']}" if ":" in ip else f"{ip}:{sock['port_value']}"
            stats = {s: 0.0 for s in (*_HOST_COUNTERS, *_HOST_GAUGES)}
            for stat in host.get("stats") or ():
                if isinstance(stat, Mapping) and stat.get("name") in stats:
                    stats[stat["name"]] = _number(stat.get("value", 0))
            health = host.get("health_status") if isinstance(host.get("health_status"), Mapping) else {}
            stats["outlier_ejected"] = 1.0 if health.get("failed_outlier_check") else 0.0
            previous = hosts.get(address)
            if previous is not None:  # the same endpoint twice in one cluster (two priorities): add up
                for key, value in stats.items():
                    previous[key] = max(previous[key], value) if key == "outlier_ejected" else previous[key] + value
            else:
                hosts[address] = stats
        out[name] = hosts
    return out


def parse_stats(text: str, wanted: Iterable[str] = ()) -> dict[str, dict[str, float]]:
    """``/stats`` text (``cluster.NAME.STAT: VALUE``) -> cluster -> reset direction -> count.

    Cluster names may contain dots, so the stat name is matched at the end.
    """
    only = set(wanted)
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if not sep or not key.startswith("cluster."):
            continue
        cluster, _, stat = key[len("cluster."):].rpartition(".")
        direction = _RESET_STATS.get(stat)
        if direction is None or not cluster or (only and cluster not in only):
            continue
        counts = out.setdefault(cluster, {"remote": 0.0, "local": 0.0})
        counts[direction] += _number(value.strip())
    return out


class EnvoyAdminCollector:
    """Per-backend proxy signals from one Envoy's admin API (see the module docstring)."""

    name = "envoy"

    def __init__(self, config: EnvoyConfig, backends: Iterable[Backend], fetch: FetchFunction = http_get,
                 clock: Any = time.time, *, deadline_seconds: float | None = None,
                 monotonic: Any = time.monotonic) -> None:
        """``deadline_seconds``: both admin reads of one collect end within it (each read also
        within ``config.timeout_seconds``); None: only the per-read timeout."""
        self.config = config
        self.deadline_seconds = deadline_seconds
        self._monotonic = monotonic
        self._base = config.admin_url.rstrip("/")
        self._by_address = {b.address: b.name for b in backends}
        self._fetch = fetch
        self._clock = clock
        self._trouble: str | None = None
        self._last_ok_ts: float | None = None
        self._errors_total = 0

    def _time_left(self, elapsed: float) -> float:
        """The timeout of a read started ``elapsed`` seconds into this collect."""
        if self.deadline_seconds is None:
            return self.config.timeout_seconds
        return min(self.config.timeout_seconds, self.deadline_seconds - elapsed)

    def collect(self, now: float) -> list[Sample]:
        started = self._monotonic()
        clusters_answer = self._fetch(f"{self._base}/clusters?format=json", self._time_left(0.0),
                                      self.config.max_bytes, "application/json")
        if not clusters_answer.ok:
            return self._failed(f"{self._base}/clusters: {clusters_answer.error}")
        try:
            doc = json.loads(clusters_answer.body)
        except ValueError as exc:
            return self._failed(f"{self._base}/clusters: not JSON: {exc}")
        if not isinstance(doc, Mapping) or not isinstance(doc.get("cluster_statuses"), list):
            return self._failed(f"{self._base}/clusters: no cluster_statuses (is this an Envoy admin port?)")
        clusters = parse_clusters(doc, self.config.clusters)
        left = self._time_left(self._monotonic() - started)
        if left < _MIN_READ_SECONDS:
            # A slow /clusters used up the tick's share: the resets wait for the next tick.
            resets, why = None, f"no time left in the tick's {self.deadline_seconds:.2g} s for /stats"
        else:
            stats_answer = self._fetch(f"{self._base}/stats?filter=%5Ecluster%5C.", left,
                                       self.config.max_bytes, "text/plain")
            resets = parse_stats(stats_answer.body, self.config.clusters) if stats_answer.ok else None
            why = f"{stats_answer.error}"
        self._trouble = None if resets is not None else f"{self._base}/stats: {why} (no reset counts)"
        if resets is None:
            self._errors_total += 1
        self._last_ok_ts = now
        return self._samples(clusters, resets)

    def _failed(self, why: str) -> list[Sample]:
        self._errors_total += 1
        if why != self._trouble:
            log.warning("envoy collector: %s", why)
        self._trouble = why
        return []

    def _samples(self, clusters: Mapping[str, Mapping[str, Mapping[str, float]]],
                 resets: Mapping[str, Mapping[str, float]] | None) -> list[Sample]:
        per_subject: dict[tuple[Scope, str], dict[str, float]] = {}
        for hosts in clusters.values():
            for address, stats in hosts.items():
                name = self._by_address.get(address)
                key = (Scope.BACKEND, name) if name is not None else (Scope.DESTINATION, address)
                total = per_subject.setdefault(key, dict.fromkeys(stats, 0.0))
                for stat, value in stats.items():
                    total[stat] = max(total[stat], value) if stat == "outlier_ejected" else total[stat] + value
        samples: list[Sample] = []
        for (scope, subject), s in per_subject.items():
            responses = Labelled()
            responses.add(s["rq_success"], **{"class": "ok"})
            responses.add(max(0.0, s["rq_error"] - s["rq_timeout"] - s["cx_connect_fail"]), **{"class": "server_5xx"})
            responses.add(s["rq_timeout"], **{"class": "timeout"})
            responses.add(s["cx_connect_fail"], **{"class": "connect_error"})
            samples += [
                Sample(scope, subject, "gateway_responses_total", responses),
                Sample(scope, subject, "gateway_connections_active", s["cx_active"]),
                Sample(scope, subject, "gateway_requests_active", s["rq_active"]),
                Sample(scope, subject, "gateway_connections_total", s["cx_total"]),
                Sample(scope, subject, "gateway_outlier_ejected", s["outlier_ejected"]),
            ]
        if resets is not None:
            per_cluster = Labelled()
            single: dict[str, Labelled] = {}
            for cluster, counts in resets.items():
                for direction, value in counts.items():
                    per_cluster.add(value, cluster=cluster, direction=direction)
                hosts = clusters.get(cluster, {})
                if len(hosts) == 1:
                    (address,) = hosts
                    name = self._by_address.get(address)
                    if name is not None:
                        labelled = single.setdefault(name, Labelled())
                        for direction, value in counts.items():
                            labelled.add(value, direction=direction)
            samples.append(Sample(Scope.HOST, "", "gateway_upstream_resets_total", per_cluster))
            samples += [Sample(Scope.BACKEND, n, "gateway_upstream_resets_total", v) for n, v in single.items()]
        return samples

    def status(self) -> CollectorStatus:
        if self._trouble is not None:
            state = CollectorState.DEGRADED
            return CollectorStatus(state, self._trouble, self._last_ok_ts, self._errors_total)
        return CollectorStatus(CollectorState.OK, None, self._last_ok_ts, self._errors_total)

    def close(self) -> None:
        pass


def build_envoy_collector(config: Config, backends: list[Backend]) -> EnvoyAdminCollector:
    """The ``envoy`` collector; raises ``LookupError`` when no admin URL is configured (the wiring reports it).

    Its two admin reads share one deadline, 0.8 of ``[agent] interval_seconds``: read one after
    the other with 1 s each, a hung admin port held every tick for 2 s, and the agent missed
    ticks for as long as Envoy hung (as a hung engine once did; see build_engine_collector)."""
    if not config.envoy.admin_url:
        raise LookupError("no Envoy admin API configured (set [envoy] admin_url, e.g. http://127.0.0.1:9901)")
    return EnvoyAdminCollector(config.envoy, backends,
                               deadline_seconds=SCRAPE_SHARE_OF_TICK * config.agent.interval_seconds)
