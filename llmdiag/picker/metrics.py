"""The picker's own Prometheus metrics (``/metrics`` of ``llmdiag picker``).

- ``llmdiag_picker_picks_total{backend}``: requests routed to each backend;
- ``llmdiag_picker_decision_seconds``: from the message that completes a request (its body, or its
  headers when it has none) arriving to the reply being ready (parse, pick, reply);
- ``llmdiag_picker_feedback_lag_seconds``: from the last response event the proxy sent (response
  headers or a body chunk) to the balancer's ``on_finish`` (how late the balancer learns a request ended;
  large when the proxy only closed the stream);
- ``llmdiag_picker_failures_total{class}``: ``bad_request`` (400), ``body_too_large`` (413),
  ``unknown_model`` (404), ``no_backend`` (503), ``subset_unknown`` (503: the subset hint names no
  known backend), ``stream_reset`` (the stream ended before the response did: client gone, reset),
  ``protocol`` (a message out of order), ``internal`` (feedback or metrics raised: a bug, logged);
- ``llmdiag_picker_responses_total{backend,class}``: the SPEC 3.2 classes of finished requests
  (``ok``, ``saturated_429``, ``client_ratelimit_429``, ``server_5xx``, ``timeout``, ``connect_error``,
  ``client_error``; requests that never finished count as ``client_error`` under status 499);
- ``llmdiag_picker_gateway_ttft_seconds``: pick to the first response body chunk of streamed 2xx answers;
- ``llmdiag_picker_streams_active``: ext_proc streams open now;
- per backend from the balancer at scrape time: ``llmdiag_picker_backend_in_flight`` (picked, not
  finished, by the picker's own count), ``llmdiag_picker_backend_load``, ``llmdiag_picker_backend_score``;
- with node agents (``--agent``): ``llmdiag_picker_backend_penalty`` (the agents' penalty applied),
  ``llmdiag_picker_agent_up{agent}`` (1 while its document is fresh),
  ``llmdiag_picker_agent_fetch_errors_total{agent}``, ``llmdiag_picker_agent_stale_documents_total``;
- with active probes: ``llmdiag_picker_probes_total``, ``llmdiag_picker_probe_failures_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["FAILURE_CLASSES", "PickerMetrics"]

FAILURE_CLASSES = ("bad_request", "body_too_large", "unknown_model", "no_backend", "subset_unknown",
                   "stream_reset", "protocol", "internal")

_DECISION_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)
_LAG_BUCKETS = (10e-6, 100e-6, 1e-3, 10e-3, 0.1, 1.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _BackendGauges(Collector):
    """Per-backend gauges read at scrape time (no work on the request path)."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, int, float, float]]]) -> None:
        self._rows = rows

    def collect(self):  # type: ignore[no-untyped-def]
        in_flight = GaugeMetricFamily("llmdiag_picker_backend_in_flight",
                                      "Requests picked for the backend and not finished yet.", labels=["backend"])
        load = GaugeMetricFamily("llmdiag_picker_backend_load",
                                 "The balancer's load for the backend (weighted pending prefill tokens + in flight).",
                                 labels=["backend"])
        score = GaugeMetricFamily("llmdiag_picker_backend_score", "The balancer's health score (0..100).",
                                  labels=["backend"])
        for name, n, backend_load, backend_score in self._rows():
            in_flight.add_metric([name], n)
            load.add_metric([name], backend_load)
            score.add_metric([name], backend_score)
        yield in_flight
        yield load
        yield score


class _AgentGauges(Collector):
    """The node agents' poll state, read at scrape time."""

    def __init__(self, agents: Any) -> None:
        self._agents = agents

    def collect(self):  # type: ignore[no-untyped-def]
        agents = self._agents
        penalty = GaugeMetricFamily("llmdiag_picker_backend_penalty", "Penalty 0..1 from the node agents, applied.",
                                    labels=["backend"])
        for name, value in agents.applied.items():
            penalty.add_metric([name], value)
        up = GaugeMetricFamily("llmdiag_picker_agent_up", "1 while the agent's penalties document is fresh.",
                               labels=["agent"])
        errors = CounterMetricFamily("llmdiag_picker_agent_fetch_errors", "Failed penalty fetches per agent.",
                                     labels=["agent"])
        for url, status in agents.agents.items():
            up.add_metric([url], 1.0 if status.fresh else 0.0)
            errors.add_metric([url], status.fetch_errors_total)
        stale = CounterMetricFamily("llmdiag_picker_agent_stale_documents",
                                    "Penalties documents found past their ttl (failed open).",
                                    value=agents.stale_documents_total)
        yield penalty
        yield up
        yield errors
        yield stale


class _ProbeCounters(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self):  # type: ignore[no-untyped-def]
        probes, failures = self._counts()
        yield CounterMetricFamily("llmdiag_picker_probes", "Active probes sent to backends.", value=probes)
        yield CounterMetricFamily("llmdiag_picker_probe_failures", "Active probes that failed.", value=failures)


class PickerMetrics:
    """Counters and histograms in their own registry; label children resolved once per backend."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry or CollectorRegistry()
        self._picks = Counter("llmdiag_picker_picks", "Requests routed, per backend.", ["backend"], registry=reg)
        self.decision = Histogram("llmdiag_picker_decision_seconds",
                                  "Time from the request's last needed message to the pick reply.",
                                  buckets=_DECISION_BUCKETS, registry=reg)
        self.feedback_lag = Histogram("llmdiag_picker_feedback_lag_seconds",
                                      "Time from the last response event seen to the balancer's on_finish.",
                                      buckets=_LAG_BUCKETS, registry=reg)
        self._failures = Counter("llmdiag_picker_failures", "Requests the picker answered itself or lost, by class.",
                                 ["class"], registry=reg)
        self._responses = Counter("llmdiag_picker_responses", "Finished requests by backend and response class.",
                                  ["backend", "class"], registry=reg)
        self._ttft = Histogram("llmdiag_picker_gateway_ttft_seconds",
                               "Pick to first response body chunk of streamed 2xx responses.", ["backend"],
                               buckets=_TTFT_BUCKETS, registry=reg)
        self.streams_active = Gauge("llmdiag_picker_streams_active", "ext_proc streams open now.", registry=reg)
        self.failures = {c: self._failures.labels(c) for c in FAILURE_CLASSES}
        self._pick_children: dict[str, Any] = {}
        self._ttft_children: dict[str, Any] = {}

    def watch_backends(self, rows: Callable[[], Iterable[tuple[str, int, float, float]]]) -> None:
        """Register the scrape-time per-backend gauges: ``rows()`` yields (name, in_flight, load, score)."""
        self.registry.register(_BackendGauges(rows))

    def watch_agents(self, agents: Any) -> None:
        """Register the node agents' gauges (an :class:`~llmdiag.router_feedback.agent_penalties.AgentPenalties`)."""
        self.registry.register(_AgentGauges(agents))

    def watch_probes(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Register the active probes' counters: ``counts()`` gives (probes, failed probes)."""
        self.registry.register(_ProbeCounters(counts))

    def picked(self, backend: str) -> None:
        child = self._pick_children.get(backend)
        if child is None:
            child = self._pick_children[backend] = self._picks.labels(backend)
        child.inc()

    def ttft(self, backend: str, seconds: float) -> None:
        child = self._ttft_children.get(backend)
        if child is None:
            child = self._ttft_children[backend] = self._ttft.labels(backend)
        child.observe(seconds)

    def response(self, backend: str, response_class: str) -> None:
        self._responses.labels(backend, response_class).inc()
