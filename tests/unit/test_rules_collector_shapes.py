"""Rules fed with what the collectors really emit: engine scrapes of Triton and TGI served over
real HTTP, the gpu collector on replayed NVML answers and a recorded /proc tree, the timewait
collector's per-destination keys for a backend named ``localhost``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_http import FIXTURES, metrics_server

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.rules.engine import finished_reason_class
from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.gpu import GpuCollector
from llmdiag.collectors.sockdiag import DestinationSockets
from llmdiag.collectors.timewait import TimewaitCollector, backend_destination
from llmdiag.config.tcp import TimewaitConfig
from llmdiag.model import Backend, Labelled, Snapshot

NVML_H200 = FIXTURES.parent / "nvml" / "h200x8.json"
PROC_TREE = FIXTURES.parent / "proc" / "host618"
T0 = 1_767_225_600.0


def _advance(text: str, per_tick: dict[str, float], tick: int) -> str:
    """The scrape ``tick`` seconds later: each counter line whose series (name + labels, as in the
    fixture) is in ``per_tick`` grows by that much per second."""
    out = []
    for line in text.split("\n"):
        for series, rate in per_tick.items():
            if line.startswith(series + " "):
                head, value = line.rsplit(" ", 1)
                line = f"{head} {float(value) + rate * tick:g}"
        out.append(line)
    return "\n".join(out)


def _engine_run(fixture: str, engine: str, per_tick: dict[str, float], seconds: int = 40) -> tuple[list[str], dict]:
    """Serve ``seconds`` scrapes of a fixture with some counters rising, collect them with the
    engine collector, analyze the snapshots: (kinds opened on the backend, its last signals)."""
    text = (FIXTURES / fixture).read_text()
    for series in per_tick:
        assert any(line.startswith(series + " ") for line in text.split("\n")), f"{series} not in {fixture}"
    bodies = [_advance(text, per_tick, i) for i in range(seconds)]
    opened: list[str] = []
    with metrics_server(*bodies) as server:
        collector = EngineCollector([Backend.from_url(server.url, name="b0", engine=engine)])
        analyzer = Analyzer(backends=[Backend.from_url(server.url, name="b0", engine=engine)])
        try:
            for i in range(seconds):
                snap = Snapshot(ts=T0 + i)
                snap.extend(collector.collect(T0 + i))
                opened += [d.kind for d in analyzer.observe(snap).opened if d.backend == "b0"]
        finally:
            collector.close()
    return opened, snap.backends["b0"]


TRITON_OK = 'nv_inference_request_success{model="llama3",version="1"}'
TGI_OK = "tgi_request_success"


@pytest.mark.parametrize(
    ("fixture", "engine", "failing", "label"),
    [
        ("triton_core_documented.prom", "triton", 'nv_inference_request_failure{model="llama3",reason="REJECTED",version="1"}', "reason=rejected"),
        ("tgi_documented.prom", "tgi", 'tgi_request_failure{err="overloaded"}', "reason=overloaded"),
    ],
    ids=["triton_rejected", "tgi_overloaded"],
)
def test_error_burst_on_engine_failure_reasons(fixture: str, engine: str, failing: str, label: str) -> None:
    ok = TRITON_OK if engine == "triton" else TGI_OK
    opened, signals = _engine_run(fixture, engine, {ok: 10.0, failing: 2.0})  # 2 of 12 fail: 17 %
    assert label in signals["requests_finished_total"]  # the shape the rule reads, from the collector
    assert "error_burst" in opened


@pytest.mark.parametrize(
    ("fixture", "engine", "client_side"),
    [
        ("triton_core_documented.prom", "triton", 'nv_inference_request_failure{model="llama3",reason="CANCELED",version="1"}'),
        ("tgi_documented.prom", "tgi", 'tgi_request_failure{err="validation"}'),
    ],
    ids=["triton_canceled", "tgi_validation"],
)
def test_client_side_failures_are_not_an_error_burst(fixture: str, engine: str, client_side: str) -> None:
    ok = TRITON_OK if engine == "triton" else TGI_OK
    opened, _ = _engine_run(fixture, engine, {ok: 10.0, client_side: 5.0})
    assert opened == []


def test_finished_reason_classes() -> None:
    assert {r: finished_reason_class(r) for r in ("stop", "length", "repetition", "ok")} == dict.fromkeys(("stop", "length", "repetition", "ok"), "ok")
    assert {r: finished_reason_class(r) for r in ("abort", "canceled", "validation")} == dict.fromkeys(("abort", "canceled", "validation"), "client")
    assert {r: finished_reason_class(r) for r in ("error", "backend", "rejected", "other", "overloaded", "unknown")} == dict.fromkeys(
        ("error", "backend", "rejected", "other", "overloaded", "unknown"), "error")


# -- GPUs from the gpu collector ------------------------------------------------------


def _gpu_run(utilization: dict[str, float], seconds: int = 12) -> list[tuple[str, str]]:
    # As config gives them: URLs only, no Backend.gpus. vLLM's API server is pid 4100 in the
    # recorded tree; its 8 tensor-parallel workers hold memory on GPUs 0-7. Nothing of vllm-1's.
    backends = [Backend.from_url("http://127.0.0.1:8000", name="vllm-0", engine="vllm", pid=4100),
                Backend.from_url("http://127.0.0.1:8001", name="vllm-1", engine="vllm", pid=77)]
    collector = GpuCollector.from_replay(NVML_H200, proc_root=PROC_TREE, xid_events=False)
    collector.set_backends(backends)
    analyzer = Analyzer(backends=[Backend.from_url(b.url, name=b.name, engine="vllm") for b in backends])
    opened = []
    try:
        for i in range(seconds):
            snap = Snapshot(ts=T0 + i)
            snap.extend(collector.collect(T0 + i))
            assert "gpus" not in snap.backends["vllm-0"] and isinstance(snap.backends["vllm-0"]["process_memory_bytes"], Labelled)
            for name in ("vllm-0", "vllm-1"):  # the engine collector's part
                snap.backends.setdefault(name, {}).update(up=1.0, requests_waiting=10.0)
            for g, signals in snap.gpus.items():  # the fault: the GPUs go idle
                signals["gpu_utilization"] = utilization.get(g, utilization["*"])
            opened += [(d.kind, d.backend) for d in analyzer.observe(snap).opened]
    finally:
        collector.close()
    return opened


def test_gpu_idle_with_queue_maps_gpus_from_the_gpu_collector() -> None:
    opened = _gpu_run({"*": 0.05})
    assert ("gpu_idle_with_queue", "vllm-0") in opened
    assert {b for _, b in opened} == {"vllm-0"}  # the recording's own faults are vllm-0's GPUs too


def test_one_busy_gpu_of_the_backend_is_not_idle() -> None:
    assert "gpu_idle_with_queue" not in {k for k, _ in _gpu_run({"*": 0.05, "3": 0.9})}  # max over its GPUs


def test_a_lost_gpu_stays_attributed_to_its_backend() -> None:
    analyzer = Analyzer(backends=[Backend.from_url("http://127.0.0.1:8000", name="vllm-0"),
                                  Backend.from_url("http://127.0.0.1:8001", name="vllm-1")])
    opened = []
    for i in range(6):
        snap = Snapshot(ts=T0 + i)
        lost = i >= 3  # GPU 1 falls off the bus: NVML no longer lists its process
        per_process = {"gpu=0,pid=4101": 7e10} if lost else {"gpu=0,pid=4101": 7e10, "gpu=1,pid=4102": 7e10}
        snap.backends["vllm-0"] = {"up": 1.0, "process_memory_bytes": Labelled(per_process)}
        snap.backends["vllm-1"] = {"up": 1.0}
        snap.gpus["0"] = {"xid_errors_total": Labelled({"xid=79": 0.0})}
        snap.gpus["1"] = {"xid_errors_total": Labelled({"xid=79": 1.0 if lost else 0.0})}
        opened += [(d.kind, d.backend) for d in analyzer.observe(snap).opened]
    assert opened == [("gpu_fault", "vllm-0")]


def test_backend_gpus_override_the_collector_mapping() -> None:
    t = Snapshot(ts=T0)
    t.backends["vllm-0"] = {"up": 1.0, "requests_waiting": 5.0, "process_memory_bytes": Labelled({"gpu=0,pid=1": 1e9})}
    t.backends["vllm-1"] = {"up": 1.0, "requests_waiting": 0.0}
    t.gpus = {"0": {"gpu_utilization": 0.9}, "1": {"gpu_utilization": 0.01}}
    analyzer = Analyzer(backends=[Backend.from_url("http://127.0.0.1:8000", name="vllm-0", gpus=(1,)),
                                  Backend.from_url("http://127.0.0.1:8001", name="vllm-1")])
    opened = []
    for i in range(8):
        t.ts = T0 + i
        opened += [(d.kind, d.backend) for d in analyzer.observe(t).opened]
    assert opened == [("gpu_idle_with_queue", "vllm-0")]  # judged on GPU 1 (override), not GPU 0


# -- destinations: the timewait collector's keys ----------------------------------------


def _proc_tree(root: Path, port_range: str) -> Path:
    (root / "net").mkdir(parents=True)
    (root / "sys/net/ipv4").mkdir(parents=True)
    (root / "net/sockstat").write_text("TCP: inuse 5 orphan 0 tw 30000 alloc 5 mem 1\n")
    (root / "sys/net/ipv4/ip_local_port_range").write_text(port_range)
    (root / "sys/net/ipv4/ip_local_reserved_ports").write_text("\n")
    (root / "sys/net/ipv4/tcp_tw_reuse").write_text("0\n")
    return root


def test_timewait_to_a_localhost_backend_lands_on_the_backend(tmp_path: Path) -> None:
    backend = Backend.from_url("http://localhost:18000", name="vllm-0", engine="vllm")
    dest = backend_destination(backend)
    assert re.fullmatch(r"(127\.0\.0\.1|\[::1\]):18000", dest)  # resolved, as the kernel reports it
    # sock_diag reports the kernel's address; the collector files it under that key
    collector = TimewaitCollector(TimewaitConfig(), [backend], proc_root=_proc_tree(tmp_path, "32768 60999\n"),
                                  diag=lambda **_: {dest: DestinationSockets(timewait=20000, timewait_recent=4000)})
    analyzer = Analyzer(backends=[backend])
    for i in range(5):
        snap = Snapshot(ts=T0 + i)
        snap.extend(collector.collect(T0 + i))
        snap.backends["vllm-0"] = {"up": 1.0}
        result = analyzer.observe(snap)
    assert list(snap.destinations) == [dest]
    assert [(d.kind, d.backend) for d in result.open] == [("timewait_exhaustion", "vllm-0")]
    assert result.backends["vllm-0"].penalty > 0


def test_connection_churn_reads_the_backends_destination_entry_rate(tmp_path: Path) -> None:
    backend = Backend.from_url("http://localhost:18000", name="vllm-0", engine="vllm")
    dest = backend_destination(backend)
    # 300 TIME_WAIT entries in the last 10 s to this backend (30/s), few in total: no exhaustion
    collector = TimewaitCollector(TimewaitConfig(rate_window_seconds=10), [backend], proc_root=_proc_tree(tmp_path, "32768 60999\n"),
                                  diag=lambda **_: {dest: DestinationSockets(timewait=1800, timewait_recent=300)})
    analyzer = Analyzer(backends=[backend])
    opened = []
    for i in range(30):
        snap = Snapshot(ts=T0 + i)
        snap.extend(collector.collect(T0 + i))
        assert "timewait_entry_rate" not in snap.host  # per destination only
        # the peer closes every connection after one request: 25 req/s, 25 closes/s
        snap.backends["vllm-0"] = {"up": 1.0, "requests_finished_total": Labelled({"reason=stop": 25.0 * i}),
                                   "tcp_peer_closes_total": 25.0 * i}
        opened += [(d.kind, d.backend) for d in analyzer.observe(snap).opened]
    assert opened == [("connection_churn", "vllm-0")]
    (d,) = analyzer.open_diagnoses()
    assert {e.signal: e.value for e in d.evidence}["TIME_WAIT entries per second"] == pytest.approx(30.0)
