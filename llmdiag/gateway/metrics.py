"""The gateway's own ``/metrics`` (Prometheus text, ``llmdiag_gateway_`` prefix).

Request-path instruments are prometheus_client counters and histograms bumped
inline; the balancer's per-backend view (score, penalty, state, in-flight load)
and the agents' poll counters are read at scrape time by a custom collector,
so nothing is copied on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmdiag.model import BackendState
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["GatewayMetrics"]

#: TTFT buckets: vLLM's (sub-ms to minutes), so gateway and engine histograms line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
#: Routing decision time: microseconds.
DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2)


class GatewayMetrics:
    def __init__(self, balancer: Balancer, agents: AgentPenalties | None, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("llmdiag_gateway_requests", "Client requests by endpoint and final response class.",
                                ["endpoint", "class"], registry=reg)
        self.responses = Counter("llmdiag_gateway_backend_responses", "Upstream attempts by backend and response class (SPEC 6.2).",
                                 ["backend", "class"], registry=reg)
        self.picks = Counter("llmdiag_gateway_picks", "Balancer picks by backend.", ["backend"], registry=reg)
        self.retries = Counter("llmdiag_gateway_retries", "Attempts retried on another backend, by the failed attempt's class.",
                               ["class"], registry=reg)
        self.no_backend = Counter("llmdiag_gateway_no_backend", "Requests answered 503 because no backend was eligible.",
                                  registry=reg)
        self.client_disconnects = Counter("llmdiag_gateway_client_disconnects",
                                          "Clients that went away before the end; the upstream request was cancelled.",
                                          registry=reg)
        self.ttft = Histogram("llmdiag_gateway_ttft_seconds", "Time to the first streamed chunk, by backend.",
                              ["backend"], buckets=TTFT_BUCKETS, registry=reg)
        self.decision = Histogram("llmdiag_gateway_decision_seconds", "Time spent in the balancer's pick, by picked backend.",
                                  ["backend"], buckets=DECISION_BUCKETS, registry=reg)
        self.in_flight = Gauge("llmdiag_gateway_requests_in_flight", "Client requests being served.", registry=reg)
        self.mirrored = Counter("llmdiag_gateway_mirrored", "Requests mirrored to the shadow backend, by outcome.",
                                ["outcome"], registry=reg)
        reg.register(_StateCollector(balancer, agents, extra))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *values: str) -> Any:  # noqa: ANN401 - a prometheus_client child
        """``metric.labels(*values)``, cached: ``labels()`` validates and locks on every call, and the
        request path asks for the same few children per request (label sets are bounded: backends,
        endpoints, response classes)."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found


class _StateCollector(Collector):
    def __init__(self, balancer: Balancer, agents: AgentPenalties | None, extra: Callable[[], dict[str, float]] | None) -> None:
        self.balancer = balancer
        self.agents = agents
        self.extra = extra

    def collect(self) -> Any:  # noqa: ANN401 - prometheus_client's protocol
        score = GaugeMetricFamily("llmdiag_gateway_backend_score", "Health score 0..100 the balancer picks with.", labels=["backend"])
        penalty = GaugeMetricFamily("llmdiag_gateway_backend_penalty", "Penalty 0..1 applied to the backend (node agents).",
                                    labels=["backend"])
        load = GaugeMetricFamily("llmdiag_gateway_backend_load", "In-flight load the balancer counts (requests + prefill tokens).",
                                 labels=["backend"])
        state = GaugeMetricFamily("llmdiag_gateway_backend_state", "1 for the backend's current state.", labels=["backend", "state"])
        for entry in self.balancer.snapshot_states():
            score.add_metric([entry.name], entry.score)
            penalty.add_metric([entry.name], entry.penalty)
            load.add_metric([entry.name], self.balancer.load(entry.name))
            for s in BackendState:
                state.add_metric([entry.name, s.value], 1.0 if s is entry.state else 0.0)
        yield from (score, penalty, load, state)
        if self.agents is not None:
            errors = CounterMetricFamily("llmdiag_gateway_agent_fetch_errors", "Failed /v1/penalties fetches per node agent.",
                                         labels=["agent"])
            fresh = GaugeMetricFamily("llmdiag_gateway_agent_fresh", "1 while the agent's penalties document is within its ttl.",
                                      labels=["agent"])
            for url, status in self.agents.agents.items():
                errors.add_metric([url], status.fetch_errors_total)
                fresh.add_metric([url], 1.0 if status.fresh else 0.0)
            yield errors
            yield fresh
            yield CounterMetricFamily("llmdiag_gateway_agent_stale_documents",
                                      "Penalties documents found past their ttl (failed open).", value=self.agents.stale_documents_total)
        counters = self.balancer.counters
        yield CounterMetricFamily("llmdiag_gateway_ejections", "Backends ejected by the circuit breaker.",
                                  value=counters.get("ejections_total", 0))
        yield CounterMetricFamily("llmdiag_gateway_cooling_enforced", "Saturation responses that put a backend in cooling.",
                                  value=counters.get("cooling_enforced_total", 0))
        if self.extra is not None:
            for name, value in self.extra().items():
                yield CounterMetricFamily(f"llmdiag_gateway_{name}", name.replace("_", " "), value=value)
