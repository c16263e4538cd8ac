"""Synthetic snapshot timelines: a healthy fleet plus one fault, for tests, the demo and the TUI.

:class:`TimelineBuilder` produces one :class:`~llmdiag.model.Snapshot` per
tick for a few backends that look like vLLM under steady load (each backend
on its own GPU, NVML memory at the 90 % vLLM preallocates). A scenario sets
gauges, counter *rates* (integrated into ``_total`` counters tick by tick),
one-off counter bumps and counter resets, then advances time::

    t = TimelineBuilder(["vllm-0", "vllm-1"])
    t.advance(40)                                        # healthy warm-up (baselines settle)
    t.backend("vllm-0").set(kv_cache_usage=0.93, requests_waiting=6).rate("preemptions_total", 0.5)
    t.advance(20)
    snapshots = t.snapshots

:data:`SCENARIOS` names a builder per catalog entry (positive: the kind must
open on the faulty backend) and per trap (negative: nothing may open).

Signals have the shapes and scopes the collectors really emit (checked by
tests/unit/test_signal_contract.py): a backend's GPUs are known only from the
gpu collector's backend-scope ``process_memory_bytes{gpu,pid}`` (the
:meth:`TimelineBuilder.backends` carry an address and a pid, no ``gpus``),
``timewait_entry_rate`` exists per destination only, HTTP/2 counters carry
``code,direction`` labels, and ``requests_finished_total`` the engines' reasons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llmdiag.model import (
    Backend,
    CollectorState,
    CollectorStatus,
    Distribution,
    Labelled,
    Snapshot,
    label_key,
)

__all__ = ["SCENARIOS", "Scenario", "TimelineBuilder", "dist"]

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: fixed so reports and golden files are stable
GIB = 1 << 30


def dist(ewma: float, p99: float | None = None, count: float = 100) -> Distribution:
    """A latency window with p50 ~ ewma and p99 ~ 3x unless given."""
    return Distribution(p50=round(ewma * 0.9, 6), p99=round(p99 if p99 is not None else ewma * 3, 6), ewma=ewma, count=count)


class Subject:
    """Gauges, counter rates and pending bumps of one backend, engine, GPU, destination or the host."""

    def __init__(self) -> None:
        self.gauges: dict[str, object] = {}
        self.rates: dict[tuple[str, str], float] = {}
        self.counters: dict[tuple[str, str], float] = {}
        self.bumps: dict[tuple[str, str], float] = {}
        self.labelled: set[str] = set()
        #: While set, the engine's scrape fails for this reason (``scrape_failure{reason}``).
        self.absent: str | None = None

    def set(self, **gauges: object) -> Subject:
        self.gauges.update(gauges)
        return self

    def drop(self, *names: str) -> Subject:
        for n in names:
            self.gauges.pop(n, None)
            for table in (self.rates, self.counters, self.bumps):
                for k in [k for k in table if k[0] == n]:
                    del table[k]
            self.labelled.discard(n)
        return self

    def rate(self, counter: str, per_second: float, **labels: str) -> Subject:
        key = (counter, label_key(**labels))
        if labels:
            self.labelled.add(counter)
        self.rates[key] = per_second
        self.counters.setdefault(key, 0.0)
        return self

    def bump(self, counter: str, amount: float = 1, **labels: str) -> Subject:
        """Add ``amount`` to a counter at the next tick (a one-off event)."""
        key = (counter, label_key(**labels))
        if labels:
            self.labelled.add(counter)
        self.bumps[key] = self.bumps.get(key, 0.0) + amount
        self.counters.setdefault(key, 0.0)
        return self

    def reset(self, counter: str) -> Subject:
        """The process restarted: the counter starts again from zero."""
        for key in self.counters:
            if key[0] == counter:
                self.counters[key] = 0.0
        return self

    def _tick(self, dt: float) -> dict[str, object]:
        for key, r in self.rates.items():
            self.counters[key] = self.counters.get(key, 0.0) + r * dt
        for key, amount in self.bumps.items():
            self.counters[key] = self.counters.get(key, 0.0) + amount
        self.bumps.clear()
        out: dict[str, object] = dict(self.gauges)
        for (name, labels), value in sorted(self.counters.items()):
            v = float(math.floor(value + 1e-9))
            if name in self.labelled:
                lab = out.setdefault(name, Labelled())
                assert isinstance(lab, Labelled)
                lab[labels] = v
            else:
                out[name] = v
        return out


@dataclass
class TimelineBuilder:
    backend_names: Iterable[str] = ("vllm-0", "vllm-1")
    start: float = T0
    interval: float = 1.0
    hostname: str = "sim-node"
    snapshots: list[Snapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.now = self.start
        self.host = Subject().set(
            psi_cpu_some_avg10=0.02, psi_io_some_avg10=0.0, psi_io_full_avg10=0.0, psi_memory_full_avg10=0.0,
            conntrack_entries=1800.0, conntrack_max=262144.0, sockstat_tcp_inuse=120.0, sockstat_tcp_tw=40.0,
        )
        self._backends: dict[str, Subject] = {}
        self._engines: dict[str, dict[str, Subject]] = {}
        self._gpus: dict[str, Subject] = {}
        self._destinations: dict[str, Subject] = {}
        self._gpu_of: dict[str, str] = {}
        for i, name in enumerate(self.backend_names):
            self._backends[name] = _healthy_backend()
            self._gpus[str(i)] = _healthy_gpu()
            self._gpu_of[name] = str(i)
        self.backend_names = tuple(self._backends)

    # -- addressing ------------------------------------------------------------
    def backend(self, name: str) -> Subject:
        return self._backends[name]

    def engine(self, backend: str, label: str) -> Subject:
        return self._engines.setdefault(backend, {}).setdefault(label, Subject())

    def gpu(self, index: int | str) -> Subject:
        return self._gpus.setdefault(str(index), _healthy_gpu())

    def destination(self, address: str) -> Subject:
        return self._destinations.setdefault(address, Subject())

    def backends(self) -> list[Backend]:
        """The backends as config/discovery know them in production: address and pid, no GPUs
        (those come from the gpu collector's per-backend process memory in each snapshot)."""
        return [
            Backend(name=n, url=f"http://127.0.0.1:{8000 + i}", engine="vllm", pid=_pid(i))
            for i, n in enumerate(self.backend_names)
        ]

    def _gpu_attribution(self, index: int, name: str) -> dict[str, object]:
        """What the gpu collector emits for a backend whose pid holds GPU memory."""
        gpu = self._gpu_of[name]
        used = _process_bytes(self._gpus[gpu].gauges.get("memory_used_bytes"))
        per_process = Labelled({label_key(gpu=gpu, pid=str(_pid(index))): used})
        return {"gpu_memory_bytes": per_process.total(), "process_memory_bytes": per_process}

    # -- time ------------------------------------------------------------------
    def advance(self, seconds: float, gap: bool = False) -> TimelineBuilder:
        """Emit one snapshot per tick for ``seconds``; with ``gap`` the agent was paused:
        counters keep counting but no snapshot is written."""
        for _ in range(int(round(seconds / self.interval))):
            self.now = round(self.now + self.interval, 6)
            snap = self._tick()
            if not gap:
                self.snapshots.append(snap)
        return self

    def _tick(self) -> Snapshot:
        dt = self.interval
        snap = Snapshot(ts=self.now, hostname=self.hostname)
        snap.host = self.host._tick(dt)  # type: ignore[assignment]
        for d, s in self._destinations.items():
            snap.destinations[d] = s._tick(dt)  # type: ignore[assignment]
        for i, (name, s) in enumerate(self._backends.items()):
            signals = s._tick(dt)
            if s.absent:  # scrape failed: the engine collector says so and gives nothing else
                signals = {"up": 0.0, "scrape_failure": Labelled({label_key(reason=s.absent): 1.0})}
            signals.update(self._gpu_attribution(i, name))
            snap.backends[name] = signals  # type: ignore[assignment]
        for name, engines in self._engines.items():
            for label, s in engines.items():
                snap.engines.setdefault(name, {})[label] = s._tick(dt)  # type: ignore[assignment]
        for i, s in self._gpus.items():
            signals = s._tick(dt)
            pids = {_pid(j): self._gpus[g].gauges.get("memory_used_bytes") for j, (n, g) in enumerate(self._gpu_of.items()) if g == i}
            signals.setdefault("process_memory_bytes", Labelled({label_key(pid=str(p)): _process_bytes(m) for p, m in pids.items()}))
            snap.gpus[i] = signals  # type: ignore[assignment]
        for c in ("engine", "tcp", "timewait", "http2", "gpu", "procfs"):
            snap.collectors[c] = CollectorStatus(CollectorState.OK, None, self.now)
        return snap


def _pid(index: int) -> int:
    return 4100 + 100 * index


def _process_bytes(memory_used: object) -> float:
    # The engine's process holds what NVML shows as used minus the driver's own ~540 MiB.
    used = memory_used if isinstance(memory_used, (int, float)) else 72.0 * GIB
    return float(used) - 540 * (1 << 20)


def _healthy_backend() -> Subject:
    s = Subject().set(
        up=1.0, requests_waiting=0.0, requests_running=8.0, kv_cache_usage=0.35, kv_capacity_tokens=200000.0,
        ttft_seconds=dist(0.3), itl_seconds=dist(0.03), e2e_seconds=dist(6.0), queue_time_seconds=dist(0.01),
        scrape_age_seconds=0.2, srtt_seconds=0.0002, tcp_connections_active=16.0, grpc_connections=0.0,
        threads_dstate=0.0, rss_bytes=8.0 * GIB, open_fds=300.0,
    )
    s.rate("preemptions_total", 0.0)
    s.rate("requests_finished_total", 4.0, reason="stop").rate("requests_finished_total", 0.0, reason="error")
    s.rate("prompt_tokens_total", 2000.0).rate("generation_tokens_total", 800.0).rate("engine_steps_total", 25.0)
    s.rate("responses_total", 4.0, **{"class": "ok"})
    s.rate("responses_total", 0.0, **{"class": "server_5xx"})
    s.rate("tcp_sends_total", 200.0).rate("tcp_send_bytes_total", 1e6).rate("tcp_retransmits_total", 0.2)
    s.rate("tcp_sndbuf_full_total", 0.0).rate("tcp_resets_sent_total", 0.0).rate("tcp_resets_received_total", 0.0)
    s.rate("tcp_peer_closes_total", 0.1).rate("tcp_active_closes_total", 0.1)
    s.rate("h2_streams_opened_total", 4.0).rate("h2_streams_closed_total", 4.0)
    s.rate("h2_rst_stream_total", 0.05, code="CANCEL", direction="received")
    s.rate("h2_flow_control_stalls_total", 0.0).rate("h2_stall_then_reset_total", 0.0)
    s.rate("io_read_bytes_total", 1e5).rate("io_rchar_total", 2e5).rate("cpu_seconds_total", 1.2)
    return s


def _healthy_gpu() -> Subject:
    s = Subject().set(
        gpu_utilization=0.85, memory_total_bytes=80.0 * GIB, memory_used_bytes=72.0 * GIB,  # vLLM preallocates 90 %
        power_watts=550.0, temperature_celsius=62.0, sm_clock_hz=1.98e9, throttle_reasons=Labelled(),
        ecc_uncorrected_total=0.0,
    )
    s.rate("xid_errors_total", 0.0, xid="0")
    return s


# -- scenarios -------------------------------------------------------------------

WARMUP = 40.0  # seconds of healthy traffic first: baselines need baseline_warmup_seconds


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    build: Callable[[], TimelineBuilder]
    #: Kinds that must open on ``backend``; empty for a trap (nothing may open).
    expect: tuple[str, ...] = ()
    backend: str = "vllm-0"
    #: Other kinds that may rightly open alongside (a slow backend is also falsely healthy).
    allow: tuple[str, ...] = ()


def _warm() -> TimelineBuilder:
    return TimelineBuilder(["vllm-0", "vllm-1"]).advance(WARMUP)


def kv_cache_saturation() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").set(kv_cache_usage=0.97, requests_waiting=4.0).rate("preemptions_total", 0.5)
    return t.advance(15)


def kv_packed_no_queue() -> TimelineBuilder:
    t = _warm()  # KV 90 % used by running requests, nothing waiting, TTFT normal: info, small penalty
    t.backend("vllm-0").set(kv_cache_usage=0.9)
    return t.advance(10)


def kv_high_but_calm() -> TimelineBuilder:
    t = _warm()  # kv packed at 0.82 (below enter) with nothing waiting, and NVML at 90 %: no diagnosis
    t.backend("vllm-0").set(kv_cache_usage=0.82)
    return t.advance(30)


def queue_avalanche() -> TimelineBuilder:
    t = _warm()
    b = t.backend("vllm-0")
    for i in range(12):
        b.set(requests_waiting=float(2 + 3 * i), ttft_seconds=dist(0.3 + 0.25 * i))
        t.advance(1)
    return t.advance(5)


def dp_engine_overloaded() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").set(requests_waiting=9.0)  # the backend's mean over 4 DP engines looks fine
    for label, waiting in (("0", 0.0), ("1", 36.0), ("2", 0.0), ("3", 0.0)):
        t.engine("vllm-0", label).set(requests_waiting=waiting, kv_cache_usage=0.5)
    return t.advance(10)


def single_slow_request() -> TimelineBuilder:
    t = _warm()
    b = t.backend("vllm-0")
    b.set(ttft_seconds=dist(0.35, p99=9.0))  # one 9 s request in the window: p99 jumps, EWMA barely moves
    t.advance(2)
    b.set(ttft_seconds=dist(0.3))
    return t.advance(20)


def false_healthy() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").set(ttft_seconds=dist(3.5))
    return t.advance(10)


def client_timeout_storm() -> TimelineBuilder:
    t = _warm()
    b = t.backend("vllm-0").set(ttft_seconds=dist(6.0))
    b.rate("h2_rst_stream_total", 6.0, code="CANCEL", direction="received").rate("tcp_peer_closes_total", 3.0)
    return t.advance(10)


def cancels_without_slowness() -> TimelineBuilder:
    t = _warm()  # a client batch job aborting its own requests: cancels up, TTFT normal
    t.backend("vllm-0").rate("h2_rst_stream_total", 6.0, code="CANCEL", direction="received")
    return t.advance(15)


def timewait_exhaustion() -> TimelineBuilder:
    t = _warm()
    t.destination("127.0.0.1:8000").set(
        timewait_sockets=20000.0, ephemeral_ports_available=8000.0, timewait_entry_rate=400.0, port_exhaustion_eta_seconds=20.0
    )
    return t.advance(5)


def timewait_some() -> TimelineBuilder:
    t = _warm()
    t.destination("127.0.0.1:8000").set(
        timewait_sockets=3000.0, ephemeral_ports_available=25000.0, timewait_entry_rate=50.0, port_exhaustion_eta_seconds=500.0
    )
    return t.advance(10)


def connection_churn() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").rate("tcp_active_closes_total", 30.0).rate("responses_total", 30.0, **{"class": "ok"})
    return t.advance(15)


def grpc_flow_control_stall() -> TimelineBuilder:
    t = _warm()
    b = t.backend("vllm-0")
    for _ in range(3):
        b.bump("h2_flow_control_stalls_total", 2)
        t.advance(1)
        # the stalled stream's consumer cancels; the http2 collector joins it to the stall on its connection
        b.bump("h2_rst_stream_total", 1, code="CANCEL", direction="received").bump("h2_stall_then_reset_total", 1)
        t.advance(3)
    return t.advance(2)


def stall_without_reset() -> TimelineBuilder:
    t = _warm()  # stalls that resolve (the reader caught up); the routine cancels go on, on other connections
    b = t.backend("vllm-0")
    for _ in range(3):
        b.bump("h2_flow_control_stalls_total", 2)
        t.advance(1)
        b.bump("h2_rst_stream_total", 1, code="CANCEL", direction="received")
        t.advance(3)
    return t.advance(2)


def network_degradation() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").rate("tcp_retransmits_total", 12.0).set(srtt_seconds=0.02)
    return t.advance(10)


def gpu_memory_pressure() -> TimelineBuilder:
    t = _warm()
    t.gpu(0).set(memory_used_bytes=79.5 * GIB)
    t.backend("vllm-0").rate("cuda_alloc_failures_total", 0.0)  # the cuda tracer counts per backend
    t.advance(2)
    t.backend("vllm-0").bump("cuda_alloc_failures_total", 3)
    return t.advance(5)


def nvml_memory_high() -> TimelineBuilder:
    t = _warm()  # gpu_memory_utilization=0.98: NVML flat at 98 %, no failures, no retries
    t.gpu(0).set(memory_used_bytes=78.5 * GIB)
    return t.advance(20)


def gpu_fault() -> TimelineBuilder:
    t = _warm()
    t.gpu(0).bump("xid_errors_total", 1, xid="79")
    return t.advance(5)


def app_xid() -> TimelineBuilder:
    t = _warm()  # XID 13 (graphics engine exception): the application's bug, not the GPU's
    t.gpu(0).bump("xid_errors_total", 1, xid="13")
    return t.advance(10)


def gpu_throttling() -> TimelineBuilder:
    t = _warm()
    t.gpu(0).set(throttle_reasons=Labelled({"reason=hw_thermal_slowdown": 1.0}), sm_clock_hz=1.2e9, temperature_celsius=91.0)
    return t.advance(10)


def idle_gpu_power_cap() -> TimelineBuilder:
    t = _warm()  # power capped while idle is normal
    t.gpu(0).set(throttle_reasons=Labelled({"reason=sw_power_cap": 1.0}), gpu_utilization=0.05)
    return t.advance(15)


def gpu_idle_with_queue() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").set(requests_waiting=7.0)
    t.gpu(0).set(gpu_utilization=0.05)
    return t.advance(10)


def io_blocking() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").set(threads_dstate=6.0).rate("io_read_bytes_total", 900e6)
    t.gpu(0).set(gpu_utilization=0.2)
    return t.advance(10)


def conntrack_pressure() -> TimelineBuilder:
    t = _warm()
    t.host.set(conntrack_entries=250000.0)
    return t.advance(5)


def error_burst() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").rate("responses_total", 1.0, **{"class": "server_5xx"}).rate("responses_total", 1.0, **{"class": "saturated_429"})
    return t.advance(20)


def client_quota_429s() -> TimelineBuilder:
    t = _warm()  # a tenant hitting its own rate limit is not the backend's fault
    t.backend("vllm-0").rate("responses_total", 3.0, **{"class": "client_ratelimit_429"})
    return t.advance(20)


def counter_reset() -> TimelineBuilder:
    t = _warm()  # engine restarted: every counter starts again from 0
    b = t.backend("vllm-0")
    for name in ("preemptions_total", "requests_finished_total", "responses_total", "tcp_retransmits_total", "tcp_sends_total", "h2_rst_stream_total", "tcp_peer_closes_total", "tcp_active_closes_total"):
        b.reset(name)
    return t.advance(20)


def scrape_gap() -> TimelineBuilder:
    t = _warm()
    t.backend("vllm-0").absent = "timeout"  # one /metrics scrape times out: a blip, not an outage
    t.advance(1)
    t.backend("vllm-0").absent = None
    t.advance(4, gap=True)  # and the agent itself was paused for 4 s
    return t.advance(10)


def backend_down() -> TimelineBuilder:
    t = _warm()  # the product's story: KV fills, allocations fail, and the engine finally dies
    b = t.backend("vllm-0").set(kv_cache_usage=0.83, requests_waiting=3.0, ttft_seconds=dist(1.8))
    b.rate("cuda_alloc_failures_total", 0.0)
    t.advance(2)
    b.bump("cuda_alloc_failures_total", 2)
    t.advance(1)
    b.absent = "connection_refused"  # crashed: the port is closed
    t.advance(12)
    b.absent = None  # restarted and answering again, cold
    b.set(kv_cache_usage=0.0, requests_waiting=0.0, ttft_seconds=dist(0.3))
    return t.advance(15)


def engine_stalled() -> TimelineBuilder:
    t = _warm()  # a hung collective: /metrics still answers, the batch stays in, nothing comes out
    b = t.backend("vllm-0")
    for counter in ("prompt_tokens_total", "generation_tokens_total", "engine_steps_total"):
        b.rate(counter, 0.0)
    b.rate("requests_finished_total", 0.0, reason="stop")
    b.set(requests_waiting=2.0)
    t.advance(12)
    b.rate("prompt_tokens_total", 2000.0).rate("generation_tokens_total", 800.0).rate("engine_steps_total", 25.0)  # it recovers
    b.rate("requests_finished_total", 4.0, reason="stop")
    b.set(requests_waiting=0.0)
    return t.advance(12)


def long_prefill_alone() -> TimelineBuilder:
    t = _warm()  # one 128k-token prompt, nothing else: no token counted until its prefill ends
    b = t.backend("vllm-0")  # (and, at worst, no step either: chunks that produce no token)
    for counter in ("prompt_tokens_total", "generation_tokens_total", "engine_steps_total"):
        b.rate(counter, 0.0)
    b.rate("requests_finished_total", 0.0, reason="stop")
    b.set(requests_running=1.0, requests_waiting=0.0)
    t.advance(4)
    b.bump("prompt_tokens_total", 128000)
    b.rate("generation_tokens_total", 30.0).rate("engine_steps_total", 30.0)
    return t.advance(10)


def healthy() -> TimelineBuilder:
    return _warm().advance(60)


def kv_flapping_at_threshold() -> TimelineBuilder:
    t = _warm()  # kv oscillating across 0.85 every 2 s never holds 3 s
    b = t.backend("vllm-0")
    for i in range(20):
        b.set(kv_cache_usage=0.86 if i % 4 < 2 else 0.83)
        t.advance(1)
    return t


_POSITIVE: list[tuple[Callable[[], TimelineBuilder], tuple[str, ...], str]] = [
    (backend_down, ("backend_down",), "allocation failures at KV 83 %, then the engine refuses connections for 12 s"),
    (engine_stalled, ("engine_stalled",), "8 running, 2 waiting, no token for 12 s, then it recovers"),
    (kv_cache_saturation, ("kv_cache_saturation",), "KV cache at 97 % with preemptions and a queue"),
    (kv_packed_no_queue, ("kv_cache_saturation",), "KV 90 % used with nothing waiting (info, small penalty)"),
    (queue_avalanche, ("queue_avalanche",), "waiting climbs 2 -> 35 while TTFT climbs 0.3 -> 3 s"),
    (dp_engine_overloaded, ("queue_avalanche",), "one of four DP engines has 36 waiting; the backend mean is 9"),
    (false_healthy, ("false_healthy",), "up=1 but TTFT 3.5 s while the peer serves in 0.3 s"),
    (client_timeout_storm, ("client_timeout_storm",), "cancels jump to 9/s while TTFT is 6 s"),
    (timewait_exhaustion, ("timewait_exhaustion",), "20k TIME_WAIT sockets to one backend, ports out in 20 s"),
    (connection_churn, ("connection_churn",), "one connection per request at 30 req/s"),
    (grpc_flow_control_stall, ("grpc_flow_control_stall",), "flow-control stalls each followed by RST_STREAM"),
    (network_degradation, ("network_degradation",), "6 % retransmits and srtt 0.2 -> 20 ms"),
    (gpu_memory_pressure, ("gpu_memory_pressure",), "NVML 99 % and cuMemAlloc failures"),
    (gpu_fault, ("gpu_fault",), "XID 79 (GPU fell off the bus)"),
    (gpu_throttling, ("gpu_throttling",), "hardware thermal slowdown while busy"),
    (gpu_idle_with_queue, ("gpu_idle_with_queue",), "7 waiting, GPU at 5 %"),
    (io_blocking, ("io_blocking",), "6 threads in D state, 900 MB/s reads, GPU util falling"),
    (conntrack_pressure, ("conntrack_pressure",), "conntrack table 95 % full"),
    (error_burst, ("error_burst",), "1/3 of responses are 5xx or saturation 429s"),
]

_NEGATIVE: list[tuple[Callable[[], TimelineBuilder], str]] = [
    (healthy, "steady traffic, nothing wrong"),
    (kv_high_but_calm, "KV 82 % (below enter) and NVML 90 % preallocated"),
    (nvml_memory_high, "NVML memory 98 % flat (preallocation), no failures"),
    (single_slow_request, "one 9 s request lifts p99 but not the EWMA"),
    (cancels_without_slowness, "cancels rise but TTFT stays normal"),
    (timewait_some, "some TIME_WAIT (11 % of the port range, ETA 500 s)"),
    (stall_without_reset, "flow-control stalls that clear without resets"),
    (app_xid, "an application XID (13)"),
    (idle_gpu_power_cap, "power cap on an idle GPU"),
    (client_quota_429s, "429s from a client's own quota"),
    (counter_reset, "an engine restart resets every counter"),
    (scrape_gap, "one failed scrape and a 4 s agent pause"),
    (kv_flapping_at_threshold, "KV crossing 0.85 for 2 s at a time"),
    (long_prefill_alone, "one long prefill alone: no token for 4 s"),
]

_EXTRA: dict[str, tuple[str, tuple[str, ...]]] = {
    "backend_down": ("vllm-0", ("gpu_memory_pressure", "queue_avalanche")),
    "queue_avalanche": ("vllm-0", ("false_healthy",)),
    "client_timeout_storm": ("vllm-0", ("false_healthy",)),
    "conntrack_pressure": ("host", ()),
    "kv_packed_no_queue": ("vllm-0", ()),
}

SCENARIOS: dict[str, Scenario] = {
    **{f.__name__: Scenario(f.__name__, d, f, kinds, *_EXTRA.get(f.__name__, ("vllm-0", ()))) for f, kinds, d in _POSITIVE},
    **{f.__name__: Scenario(f.__name__, d, f) for f, d in _NEGATIVE},
}
