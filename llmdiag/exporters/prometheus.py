"""The agent's ``/metrics``: a prometheus_client custom collector over the agent state.

Names follow docs/agent.md (agreed with the deployment's alerts and dashboard):
``llmdiag_`` prefix, base units, ``_total`` on counters.

* per backend: ``llmdiag_backend_info{backend,address,engine,pod,namespace,container,node}`` = 1,
  ``llmdiag_backend_score``, ``_penalty``, ``_weight_percent``, ``_state{state}`` (1 for the current
  one), and every numeric signal of the snapshot as ``llmdiag_backend_<signal>{backend}``
  (distributions as ``{stat="p50|p99|ewma"}``, labelled signals with their labels);
* ``llmdiag_host_<signal>``, ``llmdiag_destination_<signal>{destination}``, ``llmdiag_gpu_<signal>{gpu}``;
* ``llmdiag_diagnosis_open{backend,kind,severity}``, ``llmdiag_diagnoses_opened_total{kind,severity}``;
* ``llmdiag_collector_up``, ``_status{status}``, ``_errors_total``; ``llmdiag_bpf_lost_events_total``,
  ``llmdiag_bpf_run_time_seconds_total{program}``, ``llmdiag_bpf_run_count_total{program}``;
* the agent itself: ``llmdiag_tick_duration_seconds`` (histogram), ``llmdiag_last_tick_timestamp_seconds``,
  ``llmdiag_ticks_total``, ``llmdiag_ticks_missed_total``, ``llmdiag_agent_check_requests_total{result}``,
  ``llmdiag_agent_check_unknown_server_total``, ``llmdiag_http_unauthorized_total``.

The collector only reads what it is given (an :class:`AgentState` and an
:class:`AgentTelemetry`, both immutable); it does no IO, so a scrape never waits on a collector.

:class:`TickExposition` is what the agent serves: the state only changes once per tick, so the
text of everything derived from one ``(AgentState, AgentTelemetry)`` pair is rendered once and
reused by every scrape until the next tick; only the families that move between ticks (the
agent-check and unauthorized counters, the BPF programs' run-time statistics, the process's own
RSS and CPU) are rendered per scrape.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from llmdiag.model import NA, BackendPenalty, BackendState, CollectorState, CollectorStatus, Diagnosis, Distribution, \
    Labelled, Snapshot, parse_label_key


class AgentState(Protocol):
    """What the collector reads of :class:`llmdiag.agent.loop.AgentState` (the agent layer sits above this one)."""

    @property
    def snapshot(self) -> Snapshot | None: ...
    @property
    def open(self) -> tuple[Diagnosis, ...]: ...
    @property
    def backends(self) -> Mapping[str, BackendPenalty]: ...
    @property
    def collectors(self) -> Mapping[str, CollectorStatus]: ...

__all__ = ["TICK_BUCKETS", "AgentTelemetry", "BackendInfo", "LiveCollector", "StateCollector", "TickExposition"]

#: Upper bounds of the tick duration histogram, in seconds.
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_STATES = tuple(s.value for s in BackendState)
_STATUSES = tuple(s.value for s in CollectorState)
_LABEL_RE = re.compile(r"[^a-zA-Z0-9_]")
_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
#: Per-backend families the collector builds itself; a signal of the same name is not repeated.
_OWN_BACKEND = frozenset({"info", "score", "penalty", "weight_percent", "state"})


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """The constant labels of ``llmdiag_backend_info`` (Kubernetes ones empty when unknown)."""

    backend: str
    address: str
    engine: str = ""
    pod: str = ""
    namespace: str = ""
    container: str = ""
    node: str = ""


@dataclass(frozen=True)
class AgentTelemetry:
    """The agent's own counters at one moment (built by the agent, read by the collector)."""

    ticks_total: int = 0
    ticks_missed_total: int = 0
    #: Cumulative tick counts per bound of :data:`TICK_BUCKETS`, then the +Inf count.
    tick_bucket_counts: tuple[int, ...] = (0,) * (len(TICK_BUCKETS) + 1)
    tick_seconds_sum: float = 0.0
    last_tick_timestamp: float | None = None
    backends: tuple[BackendInfo, ...] = ()
    diagnoses_opened: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (kind, severity) -> count
    bpf_lost_events: Mapping[str, int] = field(default_factory=dict)  # collector -> count
    bpf_run_time_seconds: Mapping[str, float] = field(default_factory=dict)  # program -> seconds
    bpf_run_count: Mapping[str, int] = field(default_factory=dict)  # program -> runs
    agent_check_requests: Mapping[str, int] = field(default_factory=dict)  # result -> count
    agent_check_unknown_server_total: int = 0
    collector_seconds: Mapping[str, float] = field(default_factory=dict)  # collector -> last tick's seconds
    http_unauthorized_total: int = 0


def _number(value: Any) -> float | None:
    if value is None or value is NA or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            return None
        return number if not math.isnan(number) else None
    return None


def _label(name: str) -> str:
    label = _LABEL_RE.sub("_", name)
    return label if label and not label[0].isdigit() else f"_{label}"


class _Families:
    """Metric families by name, so that every sample of one name lands in one family."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def family(self, name: str, doc: str, labels: list[str], counter: bool) -> Metric | None:
        key = name[: -len("_total")] if counter and name.endswith("_total") else name
        existing = self.by_name.get(key)
        if existing is not None:
            same_kind = existing.type == ("counter" if counter else "gauge")
            return existing if same_kind else None
        if not _NAME_RE.match(name) or name.endswith(("_count", "_sum", "_bucket", "_created")):
            return None  # would read as a histogram/summary part: not ours to emit
        fam = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=labels)
        self.by_name[key] = fam
        return fam

    def add(self, name: str, doc: str, labels: dict[str, str], value: Any, counter: bool = False) -> None:
        number = _number(value)
        if number is None:
            return
        fam = self.family(name, doc, list(labels), counter)
        if fam is None:
            return
        # One family may see different label sets (e.g. a labelled signal on one backend only):
        # prometheus_client keeps each sample's own labels, which Prometheus accepts.
        fam.samples.append(Sample(fam.name + ("_total" if counter else ""), dict(labels), number, None, None))


def _signals(out: _Families, prefix: str, scope_labels: dict[str, str], signals: Mapping[str, Any], what: str,
             skip: frozenset[str] = frozenset()) -> None:
    for signal, value in signals.items():
        if signal in skip or not isinstance(signal, str):
            continue
        # llmdiag_gpu_utilization, not llmdiag_gpu_gpu_utilization; and no metric type in a name
        # (promtool): the engine collector's counter_resets_total becomes metric_resets_total.
        stem = signal[len("gpu_"):] if prefix == "llmdiag_gpu" and signal.startswith("gpu_") else signal
        stem = stem.replace("counter_", "metric_")
        name = f"{prefix}_{stem}"
        counter = signal.endswith("_total")
        doc = f"{what} signal {signal} (llmdiag.snapshot/v1)"
        if isinstance(value, Distribution):
            for stat in ("p50", "p99", "ewma"):
                out.add(name, doc + ", window statistic", {**scope_labels, "stat": stat}, getattr(value, stat))
        elif isinstance(value, (Labelled, Mapping)):
            for key, number in value.items():
                try:
                    extra = {_label(k): v for k, v in parse_label_key(key).items()}
                except ValueError:
                    continue
                out.add(name, doc, {**scope_labels, **extra}, number, counter)
        else:
            out.add(name, doc, scope_labels, value, counter)


class StateCollector(Collector):
    """prometheus_client custom collector: ``source()`` returns the latest ``(AgentState, AgentTelemetry)``.

    ``live=False`` leaves out the families that move between ticks (agent-check requests, unknown
    servers, unauthorized requests, BPF program run time and runs): :class:`LiveCollector` serves those.
    """

    def __init__(self, source: Callable[[], tuple[AgentState, AgentTelemetry]], live: bool = True) -> None:
        self._source = source
        self._live = live

    def describe(self) -> list[Metric]:
        return []  # families depend on the signals present: collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        state, tel = self._source()
        out = _Families()
        self._backends(out, state, tel)
        snap = state.snapshot
        if snap is not None:
            for name, signals in sorted(snap.backends.items()):
                _signals(out, "llmdiag_backend", {"backend": name}, signals, "Backend", _OWN_BACKEND)
            _signals(out, "llmdiag_host", {}, snap.host, "Host")
            for dest, signals in sorted(snap.destinations.items()):
                _signals(out, "llmdiag_destination", {"destination": dest}, signals, "Destination")
            for gpu, signals in sorted(snap.gpus.items()):
                _signals(out, "llmdiag_gpu", {"gpu": gpu}, signals, "GPU")
        self._diagnoses(out, state, tel)
        self._collectors(out, state, tel)
        yield from out.by_name.values()
        yield from self._agent(tel)
        if self._live:
            yield from _live_families(tel)

    # -- families -------------------------------------------------------------
    @staticmethod
    def _backends(out: _Families, state: AgentState, tel: AgentTelemetry) -> None:
        info = GaugeMetricFamily("llmdiag_backend_info", "Backends the agent watches (value 1)",
                                 labels=["backend", "address", "engine", "pod", "namespace", "container", "node"])
        known = {b.backend for b in tel.backends}
        for b in tel.backends:
            info.add_metric([b.backend, b.address, b.engine, b.pod, b.namespace, b.container, b.node], 1)
        for name, entry in sorted(state.backends.items()):
            if name not in known:
                lab = getattr(entry, "labels", None) or {}
                info.add_metric([name, entry.address, "", lab.get("pod", ""), lab.get("namespace", ""),
                                 lab.get("container", ""), lab.get("node", "")], 1)
        out.by_name["llmdiag_backend_info"] = info
        score = GaugeMetricFamily("llmdiag_backend_score", "Routing health score 0..100 (SPEC 6.1)", labels=["backend"])
        penalty = GaugeMetricFamily("llmdiag_backend_penalty", "Combined penalty of open diagnoses 0..1", labels=["backend"])
        weight = GaugeMetricFamily("llmdiag_backend_weight_percent", "Adaptive routing weight in percent", labels=["backend"])
        st = GaugeMetricFamily("llmdiag_backend_state", "Routing state: 1 for the current state", labels=["backend", "state"])
        for name, entry in sorted(state.backends.items()):
            score.add_metric([name], entry.score)
            penalty.add_metric([name], entry.penalty)
            weight.add_metric([name], entry.weight_percent)
            for s in _STATES:
                st.add_metric([name, s], 1.0 if entry.state.value == s else 0.0)
        for fam in (score, penalty, weight, st):
            out.by_name[fam.name] = fam

    @staticmethod
    def _diagnoses(out: _Families, state: AgentState, tel: AgentTelemetry) -> None:
        fam = GaugeMetricFamily("llmdiag_diagnosis_open", "Open diagnoses (1 each)", labels=["backend", "kind", "severity"])
        counts: dict[tuple[str, str, str], int] = {}
        for d in state.open:
            key = (d.backend, d.kind, d.severity.value)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            fam.add_metric(list(key), n)
        out.by_name[fam.name] = fam
        opened = CounterMetricFamily("llmdiag_diagnoses_opened", "Diagnoses opened since the agent started",
                                     labels=["kind", "severity"])
        for (kind, severity), n in sorted(tel.diagnoses_opened.items()):
            opened.add_metric([kind, severity], n)
        out.by_name[opened.name] = opened

    @staticmethod
    def _collectors(out: _Families, state: AgentState, tel: AgentTelemetry) -> None:
        up = GaugeMetricFamily("llmdiag_collector_up", "1 when the collector is ok, else 0", labels=["collector"])
        status = GaugeMetricFamily("llmdiag_collector_status", "Collector status: 1 for the current one",
                                   labels=["collector", "status"])
        errors = CounterMetricFamily("llmdiag_collector_errors", "Collector failures (exceptions, read errors)",
                                     labels=["collector"])
        for name, st in sorted(state.collectors.items()):
            up.add_metric([name], 1.0 if st.status is CollectorState.OK else 0.0)
            for s in _STATUSES:
                status.add_metric([name, s], 1.0 if st.status.value == s else 0.0)
            errors.add_metric([name], st.errors_total)
        lost = CounterMetricFamily("llmdiag_bpf_lost_events", "BPF events lost on the way to user space",
                                   labels=["collector"])
        for name, n in sorted(tel.bpf_lost_events.items()):
            lost.add_metric([name], n)
        duration = GaugeMetricFamily("llmdiag_collector_duration_seconds", "Seconds the collector took in the last tick",
                                     labels=["collector"])
        for name, seconds in sorted(tel.collector_seconds.items()):
            duration.add_metric([name], seconds)
        for fam in (up, status, errors, lost, duration):
            out.by_name[fam.name] = fam

    @staticmethod
    def _agent(tel: AgentTelemetry) -> Iterator[Metric]:
        buckets = [(repr(float(b)), float(n)) for b, n in zip(TICK_BUCKETS, tel.tick_bucket_counts)]
        buckets.append(("+Inf", float(tel.tick_bucket_counts[-1])))
        yield HistogramMetricFamily("llmdiag_tick_duration_seconds", "Collection + analysis time per tick",
                                    buckets=buckets, sum_value=tel.tick_seconds_sum)
        last = GaugeMetricFamily("llmdiag_last_tick_timestamp_seconds", "Unix time of the last finished tick")
        if tel.last_tick_timestamp is not None:
            last.add_metric([], tel.last_tick_timestamp)
        yield last
        yield CounterMetricFamily("llmdiag_ticks", "Ticks finished", value=tel.ticks_total)
        yield CounterMetricFamily("llmdiag_ticks_missed", "Ticks skipped because the previous one ran late",
                                  value=tel.ticks_missed_total)


def _live_families(tel: AgentTelemetry) -> Iterator[Metric]:
    """What moves between ticks: the counters the asyncio thread keeps, and the BPF programs'
    run-time statistics (read from ``/proc/self/fdinfo`` when a scrape asks, not every tick)."""
    run_time = CounterMetricFamily("llmdiag_bpf_run_time_seconds", "In-kernel run time of the agent's BPF programs "
                                   "(kernel.bpf_stats_enabled=1)", labels=["program"])
    run_count = CounterMetricFamily("llmdiag_bpf_run_count", "Runs of the agent's BPF programs "
                                    "(kernel.bpf_stats_enabled=1)", labels=["program"])
    for prog, seconds in sorted(tel.bpf_run_time_seconds.items()):
        run_time.add_metric([prog], seconds)
    for prog, n in sorted(tel.bpf_run_count.items()):
        run_count.add_metric([prog], n)
    yield run_time
    yield run_count
    req = CounterMetricFamily("llmdiag_agent_check_requests", "HAProxy agent-check connections by result",
                              labels=["result"])
    for result, n in sorted(tel.agent_check_requests.items()):
        req.add_metric([result], n)
    yield req
    yield CounterMetricFamily("llmdiag_agent_check_unknown_server", "Agent-check requests naming no known backend "
                              "(answered ready up 100%)", value=tel.agent_check_unknown_server_total)
    yield CounterMetricFamily("llmdiag_http_unauthorized", "HTTP requests refused for a missing or wrong bearer token",
                              value=tel.http_unauthorized_total)


class LiveCollector(Collector):
    """The families :class:`StateCollector` leaves out with ``live=False``; ``source()`` returns an
    :class:`AgentTelemetry` whose live counters are current (the others are not read)."""

    def __init__(self, source: Callable[[], AgentTelemetry]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from _live_families(self._source())


class TickExposition:
    """The ``/metrics`` body: the tick's families rendered once per tick, the live ones per scrape.

    ``tick_source()`` returns the published ``(AgentState, AgentTelemetry)``; both are replaced (never
    mutated) when a tick ends, so the pair's identity says whether the cached text is still the
    current one. ``live`` is a registry of what moves between ticks (:class:`LiveCollector`,
    prometheus_client's ``ProcessCollector``), rendered on every call. :meth:`render` is safe from
    any thread; concurrent scrapes of a new tick render it once.
    """

    def __init__(self, tick_source: Callable[[], tuple[AgentState, AgentTelemetry]], live: CollectorRegistry) -> None:
        self._tick_source = tick_source
        self._live = live
        self._pair: tuple[AgentState, AgentTelemetry] | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(StateCollector(self._current, live=False))
        self._text = b""
        self._lock = threading.Lock()
        #: How many times the tick's families were rendered (tests, benchmarks).
        self.renders = 0

    def _current(self) -> tuple[AgentState, AgentTelemetry]:
        assert self._pair is not None
        return self._pair

    def render(self) -> bytes:
        state, tel = self._tick_source()
        with self._lock:
            pair = self._pair
            if pair is None or pair[0] is not state or pair[1] is not tel:
                self._pair = (state, tel)
                self._text = generate_latest(self._registry)
                self.renders += 1
            text = self._text
        return text + generate_latest(self._live)
