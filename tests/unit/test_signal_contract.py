"""The contract between collectors and their readers: every signal a rule or the balancer reads,
at the scope it reads it, is one some collector emits there, unless it is listed in
:data:`FUTURE_SOURCES` (documented in docs/diagnoses.md, "Signals from future sources").

*Reads* are recorded while the rules run over every scenario timeline (and the balancer takes
a snapshot's backend signals): the snapshot's signal maps and the rolling windows log each
name looked up. *Emitted* names come from running the collectors on their own test inputs
(engine scrapes served over HTTP, NVML replay with the recorded /proc tree, the recorded /proc
tree for procfs and timewait); the BPF collectors (tcp, http2, cuda alloc tracer) cannot run
without root here, so their names are the string literals of their modules, at the scopes their
docstrings give. The same test checks that the timelines only carry what collectors emit.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_http import FIXTURES, SHARED_ENGINES, metrics_server
from prometheus_client import CollectorRegistry, generate_latest

import llmdiag.collectors.cuda_alloc as cuda_alloc_module
import llmdiag.collectors.http2 as http2_module
import llmdiag.collectors.tcp as tcp_module
from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.analyzers.windows import WindowStore
from llmdiag.collectors.allocator_exporter import register as register_allocator
from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.gpu import GpuCollector
from llmdiag.collectors.procfs import ProcCollector
from llmdiag.collectors.sockdiag import DestinationSockets
from llmdiag.collectors.timewait import TimewaitCollector
from llmdiag.model import Backend, Labelled, Sample, Snapshot, parse_label_key
from llmdiag.router_feedback.balancer import Balancer

PROC_TREE = FIXTURES.parent / "proc" / "host618"
NVML_H200 = FIXTURES.parent / "nvml" / "h200x8.json"

#: (scope, signal) read by rules but emitted by no collector yet. Empty: ``responses_total{class}``
#: (SPEC 3.2 "gateway feedback") comes from the engine's own ``http_requests_total{status}``; the
#: envoy collector's gateway view of the same classes is ``gateway_responses_total{class}``.
FUTURE_SOURCES: set[tuple[str, str]] = set()

_SCOPE_OF_PREFIX = {"b": "backend", "e": "engine", "g": "gpu", "d": "destination", "h": "host"}


# -- reads ---------------------------------------------------------------------------


class _Reads:
    def __init__(self) -> None:
        self.names: set[tuple[str, str]] = set()
        self.active = False

    def add(self, scope: str, name: str) -> None:
        if self.active:
            self.names.add((scope, name))

    def add_key(self, key: str) -> None:
        # b/<backend>/<signal>, e/<backend>/<engine>/<signal>, g/<gpu>/..., d/<ip:port>/..., h//...
        prefix, rest = key.split("/", 1)
        signal = rest.split("/", 2 if prefix == "e" else 1)[-1]
        signal = re.sub(r"\{.*\}$", "", signal)
        signal = re.sub(r"\.(p50|p99|ewma)$", "", signal)
        self.add(_SCOPE_OF_PREFIX[prefix], signal)


class _RecordingSignals(dict):
    """A signal map that logs the names looked up (iteration, as the windows do, is not a read)."""

    def __init__(self, scope: str, reads: _Reads, signals: dict) -> None:
        super().__init__(signals)
        self._scope, self._reads = scope, reads

    def get(self, name: str, default: Any = None) -> Any:
        self._reads.add(self._scope, name)
        return super().get(name, default)

    def __getitem__(self, name: str) -> Any:
        self._reads.add(self._scope, name)
        return super().__getitem__(name)

    def __contains__(self, name: object) -> bool:
        self._reads.add(self._scope, str(name))
        return super().__contains__(name)


class _RecordingWindows(WindowStore):
    reads: _Reads

    def rate(self, key, seconds):
        self.reads.add_key(key)
        return super().rate(key, seconds)

    def increase(self, key, seconds):
        self.reads.add_key(key)
        return super().increase(key, seconds)

    def value_ago(self, key, seconds):
        self.reads.add_key(key)
        return super().value_ago(key, seconds)

    def increments(self, key, seconds):
        self.reads.add_key(key)
        return super().increments(key, seconds)

    def series(self, key):
        self.reads.add_key(key)
        return super().series(key)


def _recording(snap: Snapshot, reads: _Reads) -> Snapshot:
    out = Snapshot(ts=snap.ts, hostname=snap.hostname)
    out.host = _RecordingSignals("host", reads, snap.host)
    out.destinations = {d: _RecordingSignals("destination", reads, s) for d, s in snap.destinations.items()}
    out.backends = {b: _RecordingSignals("backend", reads, s) for b, s in snap.backends.items()}
    out.engines = {b: {e: _RecordingSignals("engine", reads, s) for e, s in es.items()} for b, es in snap.engines.items()}
    out.gpus = {g: _RecordingSignals("gpu", reads, s) for g, s in snap.gpus.items()}
    out.collectors = dict(snap.collectors)
    return out


def _rule_reads() -> set[tuple[str, str]]:
    reads = _Reads()
    for scenario in SCENARIOS.values():
        t = scenario.build()
        analyzer = Analyzer(backends=t.backends())
        windows = _RecordingWindows(analyzer.config.window_seconds)
        windows.reads = reads
        analyzer.windows = windows
        for rule in analyzer.rules:
            rule.evaluate = _while_recording(rule.evaluate, reads)  # type: ignore[method-assign]
        for snap in t.snapshots:
            analyzer.observe(_recording(snap, reads))
    return reads.names


def _while_recording(evaluate, reads: _Reads):
    def recorded(ctx) -> Iterator:
        reads.active = True
        try:
            yield from evaluate(ctx)
        finally:
            reads.active = False
    return recorded


def _balancer_reads() -> set[tuple[str, str]]:
    reads = _Reads()
    reads.active = True
    t = SCENARIOS["healthy"].build()
    balancer = Balancer(t.backends())
    for snap in t.snapshots[-3:]:
        for name, signals in snap.backends.items():
            balancer.update_signals(name, _RecordingSignals("backend", reads, signals))
    return reads.names


# -- emitted ---------------------------------------------------------------------------


def _pairs(samples: list[Sample], out: dict[tuple[str, str], set[str]]) -> None:
    for s in samples:
        labels = out.setdefault((s.scope.value, s.name), set())
        if isinstance(s.value, Labelled):
            for key in s.value:
                labels.update(parse_label_key(key))


def _allocator_text() -> str:
    """What the in-process allocator exporter adds to an engine's /metrics (one device)."""
    stats = {"reserved_bytes.all.current": 40 << 30, "allocated_bytes.all.current": 30 << 30,
             "inactive_split_bytes.all.current": 6 << 30, "num_alloc_retries": 1, "num_ooms": 0}
    registry = CollectorRegistry()
    register_allocator(registry, stats_source=lambda device: stats, devices=[0])
    return generate_latest(registry).decode()


def _engine_emitted(out: dict[tuple[str, str], set[str]]) -> None:
    scrapes = [p.read_text() for p in sorted(FIXTURES.glob("*.prom")) + sorted(SHARED_ENGINES.glob("*"))]
    assert len(scrapes) >= 6
    scrapes.append(scrapes[-1] + _allocator_text())
    for text in scrapes:
        with metrics_server(text) as server:
            collector = EngineCollector([Backend.from_url(server.url, name="b0")])
            try:
                for i in range(2):
                    _pairs(collector.collect(float(i)), out)
            finally:
                collector.close()
    # A backend whose scrape fails: up = 0 and scrape_failure{reason}.
    with metrics_server("") as server:
        closed = server.url
    collector = EngineCollector([Backend.from_url(closed, name="b0")])
    _pairs(collector.collect(0.0), out)
    collector.close()


def _gpu_emitted(out: dict[tuple[str, str], set[str]]) -> None:
    collector = GpuCollector.from_replay(NVML_H200, [Backend("vllm-0", "http://127.0.0.1:8000", pid=4100)],
                                         proc_root=PROC_TREE, xid_events=False)
    try:
        for i in range(3):
            _pairs(collector.collect(float(i)), out)
    finally:
        collector.close()
    # xid_errors_total comes from the XID event thread (exercised in test_gpu_collector.py):
    # a labelled GPU-scope counter {xid}.
    out.setdefault(("gpu", "xid_errors_total"), set()).add("xid")


def _proc_emitted(out: dict[tuple[str, str], set[str]], tmp: Path) -> None:
    collector = ProcCollector([Backend("vllm-0", "http://127.0.0.1:8000", pid=4100)], proc_root=PROC_TREE, clock_ticks=100)
    for i in range(2):
        _pairs(collector.collect(float(i)), out)
    (tmp / "net").mkdir(parents=True)
    (tmp / "sys/net/ipv4").mkdir(parents=True)
    (tmp / "net/sockstat").write_text("TCP: inuse 5 orphan 0 tw 300 alloc 5 mem 1\n")
    (tmp / "sys/net/ipv4/ip_local_port_range").write_text("32768 60999\n")
    (tmp / "sys/net/ipv4/ip_local_reserved_ports").write_text("\n")
    (tmp / "sys/net/ipv4/tcp_tw_reuse").write_text("2\n")
    timewait = TimewaitCollector(backends=[Backend("vllm-0", "http://127.0.0.1:8000")], proc_root=tmp,
                                 diag=lambda **_: {"127.0.0.1:8000": DestinationSockets(timewait=300, timewait_recent=30)})
    _pairs(timewait.collect(1.0), out)


#: The BPF collectors, by the scopes their module docstrings give.
_BPF_MODULES = (
    (tcp_module, ("backend", "destination", "host")),
    (http2_module, ("backend",)),
    (cuda_alloc_module, ("backend", "host")),
)
#: Label names of the BPF collectors' labelled signals (their docstrings; the root tests check them).
_BPF_LABELS = {
    "h2_rst_stream_total": {"code", "direction"},
    "h2_goaway_total": {"code", "direction"},
    "h2_window_update_total": {"direction"},
    "h2_settings_total": {"direction"},
    "cuda_outstanding_bytes": {"pid"},
    "cuda_alloc_failures_by_code_total": {"code"},
    "cuda_api_calls_total": {"api", "code"},
    "tcp_mem_pressure_total": {"kind"},
    "bpf_map_full_total": {"program"},
}


def _bpf_emitted(out: dict[tuple[str, str], set[str]]) -> None:
    for module, scopes in _BPF_MODULES:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", node.value):
                for scope in scopes:
                    out.setdefault((scope, node.value), set()).update(_BPF_LABELS.get(node.value, ()))


def _envoy_emitted(out: dict[tuple[str, str], set[str]]) -> None:
    from llmdiag.collectors.envoy_admin import EnvoyAdminCollector
    from llmdiag.collectors.http_fetch import FetchResult
    from llmdiag.config.picker import EnvoyConfig

    recorded = FIXTURES.parent / "envoy"

    def fetch(url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        name = "clusters.json" if "/clusters" in url else "stats.txt"
        return FetchResult(url, status=200, body=(recorded / name).read_text())

    backends = [Backend.from_url(f"http://127.0.0.1:{p}", name=f"b{p}") for p in (49559, 58281, 34207, 50431)]
    _pairs(EnvoyAdminCollector(EnvoyConfig(admin_url="http://127.0.0.1:9901"), backends, fetch).collect(1.0), out)


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    _engine_emitted(out)
    _gpu_emitted(out)
    _proc_emitted(out, tmp_path_factory.mktemp("proc"))
    _bpf_emitted(out)
    _envoy_emitted(out)
    return out


# -- the contract ------------------------------------------------------------------------


def test_runnable_collectors_emit_what_the_rules_are_built_on(emitted) -> None:
    # A sanity check of the gathering itself (else an empty set would pass everything below).
    for pair in [("backend", "requests_finished_total"), ("engine", "requests_waiting"), ("gpu", "gpu_utilization"),
                 ("backend", "process_memory_bytes"), ("destination", "timewait_entry_rate"), ("host", "psi_io_full_avg10"),
                 ("backend", "threads_dstate"), ("backend", "h2_stall_then_reset_total"), ("backend", "cuda_alloc_failures_total")]:
        assert pair in emitted, pair
    assert ("host", "timewait_entry_rate") not in emitted
    assert emitted[("backend", "process_memory_bytes")] == {"gpu", "pid"}
    assert emitted[("backend", "requests_finished_total")] == {"reason"}
    assert emitted[("backend", "responses_total")] == {"class"}
    assert emitted[("backend", "scrape_failure")] == {"reason"}


def test_every_signal_a_rule_reads_is_emitted_by_a_collector(emitted) -> None:
    reads = _rule_reads()
    assert len(reads) > 40  # the recording saw the rules at work
    missing = sorted(r for r in reads - set(emitted) if r not in FUTURE_SOURCES)
    assert missing == [], f"rules read signals no collector emits: {missing}"


def test_every_signal_the_balancer_reads_is_emitted_by_a_collector(emitted) -> None:
    reads = _balancer_reads()
    assert ("backend", "requests_waiting") in reads
    missing = sorted(r for r in reads - set(emitted) if r not in FUTURE_SOURCES)
    assert missing == [], f"the balancer reads signals no collector emits: {missing}"


def test_future_sources_are_read_and_not_yet_emitted(emitted) -> None:
    # When a collector starts emitting one, move it out of the table (and docs/diagnoses.md).
    assert FUTURE_SOURCES <= _rule_reads()
    assert FUTURE_SOURCES.isdisjoint(emitted)


def test_timelines_carry_only_emitted_signals_and_labels(emitted) -> None:
    bad: set[str] = set()
    for scenario in SCENARIOS.values():
        for snap in scenario.build().snapshots:
            scopes = [("host", snap.host), *(("destination", s) for s in snap.destinations.values()),
                      *(("backend", s) for s in snap.backends.values()), *(("gpu", s) for s in snap.gpus.values()),
                      *(("engine", s) for es in snap.engines.values() for s in es.values())]
            for scope, signals in scopes:
                for name, value in signals.items():
                    if (scope, name) in FUTURE_SOURCES:
                        continue
                    if (scope, name) not in emitted:
                        bad.add(f"{scenario.name}: {scope}.{name}")
                    elif isinstance(value, Labelled):
                        for key in value:
                            extra = set(parse_label_key(key)) - emitted[(scope, name)]
                            if extra:
                                bad.add(f"{scenario.name}: {scope}.{name} labels {sorted(extra)}")
    assert sorted(bad) == []
