"""``[diagnosis]``: analyzer windows, baselines and one subsection per diagnosis kind.

Every kind of the SPEC section 5 catalog has its own table with the common
keys of :class:`RuleConfig` plus its own thresholds::

    [diagnosis]
    window_seconds = 300          # how much history the rolling windows keep

    [diagnosis.kv_cache_saturation]
    enter = 0.85                  # kv_cache_usage that opens the diagnosis ...
    exit = 0.80                   # ... and the level it must fall below to close
    for_seconds = 3               # the enter condition must hold this long
    hold_seconds = 10             # an open diagnosis stays open at least this long
    enforce = false               # detect and report, but add no penalty

Hysteresis: a diagnosis opens when its *enter* condition has held for
``for_seconds``, and closes only when its (looser) *exit* condition fails and
it has been open ``hold_seconds``; enter thresholds are checked to lie beyond
exit thresholds at load. ``enabled = false`` turns the rule off entirely;
``enforce = false`` keeps detecting it (counted as *detected*, not
*enforced*) without adding its penalty to the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = [
    "BackendDownConfig",
    "ClientTimeoutStormConfig",
    "ConnectionChurnConfig",
    "ConntrackPressureConfig",
    "DiagnosisConfig",
    "ErrorBurstConfig",
    "FalseHealthyConfig",
    "GpuFaultConfig",
    "GpuIdleWithQueueConfig",
    "GpuMemoryPressureConfig",
    "GpuThrottlingConfig",
    "GrpcFlowControlStallConfig",
    "IoBlockingConfig",
    "KvCacheSaturationConfig",
    "NetworkDegradationConfig",
    "QueueAvalancheConfig",
    "RuleConfig",
    "TimewaitExhaustionConfig",
]


def _unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in 0..1, got {value}")


def _nonneg(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _above(enter_name: str, enter: float, exit_name: str, exit_: float) -> None:
    # Hysteresis needs a gap: closing must be harder than staying below the entry bar.
    if not enter >= exit_:
        raise ValueError(f"{enter_name} ({enter}) must be >= {exit_name} ({exit_}) so the diagnosis cannot flap")


@dataclass(frozen=True)
class RuleConfig:
    """Keys every diagnosis kind has."""

    #: Evaluate the rule at all.
    enabled: bool = True
    #: Add the penalty to the backend while open (else detected and reported only).
    enforce: bool = True
    #: Seconds the enter condition must hold before the diagnosis opens.
    for_seconds: float = 0.0
    #: Minimum seconds a diagnosis stays open once opened (anti-flap).
    hold_seconds: float = 10.0
    #: Penalty (0..1) at warning severity.
    penalty: float = 0.25
    #: Penalty (0..1) at critical severity.
    critical_penalty: float = 0.5

    def __post_init__(self) -> None:
        _nonneg("for_seconds", self.for_seconds)
        _nonneg("hold_seconds", self.hold_seconds)
        _unit("penalty", self.penalty)
        _unit("critical_penalty", self.critical_penalty)


@dataclass(frozen=True)
class BackendDownConfig(RuleConfig):
    """A backend that stopped answering: critical, penalty 1 (the balancer ejects it)."""

    #: Opens once the engine has gone unanswered this long since its last good scrape, as the
    #: engine collector measures it (``scrape_age_seconds``): 1.5 s = two failed scrapes at the
    #: default 1 s tick, or one scrape that hung for its whole 1 s deadline (``[engine]
    #: timeout_seconds``). One quick failure after a good scrape is not an outage.
    unanswered_seconds: float = 1.5
    #: A refused connection opens it at the first refusal: nothing listens on the port (the
    #: process died or is restarting), which every request sent there would meet too. ``false``
    #: treats refusals like any other failure (``unanswered_seconds``).
    open_on_refused: bool = True
    #: Extra hold on top of ``unanswered_seconds`` (the generic enter delay); 0 by default.
    for_seconds: float = 0.0
    hold_seconds: float = 5.0
    penalty: float = 1.0
    critical_penalty: float = 1.0
    #: It closes once the engine has answered every scrape for this long (the exit hysteresis).
    recover_seconds: float = 3.0
    #: Allocation failures, OOMs and preemptions within this many seconds before (and during)
    #: the outage are quoted in the evidence, with the last KV, TTFT and GPU memory seen.
    lookback_seconds: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _nonneg("recover_seconds", self.recover_seconds)
        _nonneg("unanswered_seconds", self.unanswered_seconds)
        if not self.lookback_seconds > 0:
            raise ValueError(f"lookback_seconds must be > 0, got {self.lookback_seconds}")


@dataclass(frozen=True)
class EngineStalledConfig(RuleConfig):
    """An engine with work that produces nothing (a hang its /metrics does not show): critical."""

    #: No prompt or generation token for this long, with requests
    #: running or waiting the whole time, opens it. A decoding batch produces tokens every step
    #: (tens of ms); 5 s also covers one long chunked prefill on its own.
    stalled_seconds: float = 5.0
    hold_seconds: float = 5.0
    penalty: float = 1.0
    critical_penalty: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.stalled_seconds > 0:
            raise ValueError(f"stalled_seconds must be > 0, got {self.stalled_seconds}")


@dataclass(frozen=True)
class KvCacheSaturationConfig(RuleConfig):
    for_seconds: float = 3.0
    #: kv_cache_usage (0..1, from the engine, not NVML) that opens / must be left to close.
    enter: float = 0.85
    exit: float = 0.80
    #: Preemptions within this many seconds count as "preemptions rising".
    preemption_window_seconds: float = 10.0
    #: kv usage at or above this, together with preemptions, is critical.
    critical_usage: float = 0.95
    #: Penalty when kv is high but nothing else hurts yet (no queue, no preemptions): info severity.
    info_penalty: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("enter", self.enter)
        _unit("exit", self.exit)
        _unit("critical_usage", self.critical_usage)
        _unit("info_penalty", self.info_penalty)
        _above("enter", self.enter, "exit", self.exit)


@dataclass(frozen=True)
class QueueAvalancheConfig(RuleConfig):
    for_seconds: float = 2.0
    penalty: float = 0.3
    critical_penalty: float = 0.6
    #: Waiting requests that open the diagnosis on their own / that keep it open.
    waiting_enter: float = 30.0
    waiting_exit: float = 20.0
    #: TTFT EWMA over the backend's own baseline that (with a rising queue) opens / keeps it open.
    ttft_ratio_enter: float = 2.0
    ttft_ratio_exit: float = 1.5
    #: Below this TTFT EWMA the ratio test is ignored (2x of 40 ms is not an avalanche).
    ttft_floor_seconds: float = 0.5
    #: "Rising" compares the queue with its value this many seconds ago.
    rise_window_seconds: float = 10.0
    #: Waiting at or above this multiple of waiting_enter is critical.
    critical_factor: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("waiting_enter", self.waiting_enter, "waiting_exit", self.waiting_exit)
        _above("ttft_ratio_enter", self.ttft_ratio_enter, "ttft_ratio_exit", self.ttft_ratio_exit)
        _nonneg("rise_window_seconds", self.rise_window_seconds)


@dataclass(frozen=True)
class FalseHealthyConfig(RuleConfig):
    for_seconds: float = 3.0
    penalty: float = 0.4
    critical_penalty: float = 0.7
    #: TTFT EWMA (s) that counts as slow while /health (``up``) answers fine.
    ttft_enter_seconds: float = 2.0
    ttft_exit_seconds: float = 1.5
    #: Peers are "normal" when their median TTFT EWMA is below this fraction of ttft_enter_seconds.
    peer_fraction: float = 0.5
    #: TTFT EWMA at or above this multiple of ttft_enter_seconds is critical.
    critical_factor: float = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("ttft_enter_seconds", self.ttft_enter_seconds, "ttft_exit_seconds", self.ttft_exit_seconds)
        _unit("peer_fraction", self.peer_fraction)


@dataclass(frozen=True)
class ClientTimeoutStormConfig(RuleConfig):
    for_seconds: float = 2.0
    penalty: float = 0.35
    critical_penalty: float = 0.6
    #: Cancels (RST_STREAM CANCEL + TCP peer closes) per second over the baseline rate.
    rate_factor_enter: float = 4.0
    rate_factor_exit: float = 2.0
    #: A rate below this (per second) is never a storm, whatever the baseline.
    min_rate: float = 1.0
    #: Seconds over which the cancel rate is measured.
    rate_window_seconds: float = 5.0
    #: TTFT EWMA (s) that counts as "high" ...
    ttft_high_seconds: float = 2.0
    #: ... or this multiple of the backend's TTFT baseline.
    ttft_ratio: float = 2.0
    #: Cancels and high TTFT are joined when within this many seconds of each other.
    correlate_seconds: float = 5.0
    #: A cancel rate this many times the baseline is critical.
    critical_factor: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("rate_factor_enter", self.rate_factor_enter, "rate_factor_exit", self.rate_factor_exit)


@dataclass(frozen=True)
class TimewaitExhaustionConfig(RuleConfig):
    penalty: float = 0.1
    critical_penalty: float = 0.2
    #: TIME_WAIT sockets to one destination as a fraction of its port range.
    fraction_enter: float = 0.5
    fraction_exit: float = 0.4
    #: Seconds until the destination's ephemeral ports run out.
    eta_enter_seconds: float = 300.0
    eta_exit_seconds: float = 600.0
    #: Fraction or ETA beyond these is critical.
    critical_fraction: float = 0.8
    critical_eta_seconds: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("fraction_enter", self.fraction_enter)
        _unit("fraction_exit", self.fraction_exit)
        _above("fraction_enter", self.fraction_enter, "fraction_exit", self.fraction_exit)
        _above("eta_exit_seconds", self.eta_exit_seconds, "eta_enter_seconds", self.eta_enter_seconds)


@dataclass(frozen=True)
class ConnectionChurnConfig(RuleConfig):
    for_seconds: float = 5.0
    #: A client-side pooling problem: routing elsewhere does not fix it, so no penalty by default.
    penalty: float = 0.0
    critical_penalty: float = 0.0
    #: Connections closed per request (no reuse ~ 1).
    ratio_enter: float = 0.8
    ratio_exit: float = 0.5
    #: TIME_WAIT entries per second (backend active closes, or the backend destination's timewait_entry_rate).
    tw_rate_enter: float = 20.0
    #: Requests per second below which the ratio means nothing.
    min_request_rate: float = 1.0
    rate_window_seconds: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("ratio_enter", self.ratio_enter, "ratio_exit", self.ratio_exit)


@dataclass(frozen=True)
class GrpcFlowControlStallConfig(RuleConfig):
    penalty: float = 0.2
    critical_penalty: float = 0.4
    #: A stall followed within this many seconds by RST_STREAM/GOAWAY on the same connection
    #: (the http2 collector does the per-connection join with this window).
    follow_seconds: float = 2.0
    #: Resets that followed a stall (h2_stall_then_reset_total) are counted over this window.
    window_seconds: float = 10.0
    min_matches: int = 1
    #: This many matches in the window is critical.
    critical_matches: int = 5


@dataclass(frozen=True)
class NetworkDegradationConfig(RuleConfig):
    for_seconds: float = 3.0
    penalty: float = 0.3
    critical_penalty: float = 0.5
    #: Retransmits per send over the backend's baseline ratio, and an absolute floor.
    retransmit_factor_enter: float = 3.0
    retransmit_factor_exit: float = 1.5
    retransmit_ratio_floor: float = 0.01
    #: Sends per second below which the ratio is noise.
    min_send_rate: float = 10.0
    #: srtt over its baseline, and an absolute floor (loopback srtt is tens of microseconds).
    srtt_factor_enter: float = 3.0
    srtt_factor_exit: float = 1.5
    srtt_floor_seconds: float = 0.005
    rate_window_seconds: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("retransmit_factor_enter", self.retransmit_factor_enter, "retransmit_factor_exit", self.retransmit_factor_exit)
        _above("srtt_factor_enter", self.srtt_factor_enter, "srtt_factor_exit", self.srtt_factor_exit)


@dataclass(frozen=True)
class GpuMemoryPressureConfig(RuleConfig):
    hold_seconds: float = 30.0
    penalty: float = 0.3
    critical_penalty: float = 0.6
    #: NVML memory_used / memory_total. vLLM preallocates ~90 %, so this alone means nothing.
    used_enter: float = 0.97
    used_exit: float = 0.95
    #: allocator inactive_split / reserved.
    fragmentation_enter: float = 0.3
    #: Failures, OOMs or retries within this many seconds count.
    event_window_seconds: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("used_enter", self.used_enter)
        _unit("used_exit", self.used_exit)
        _above("used_enter", self.used_enter, "used_exit", self.used_exit)
        _unit("fragmentation_enter", self.fragmentation_enter)


@dataclass(frozen=True)
class GpuFaultConfig(RuleConfig):
    #: A faulted GPU needs a reset; keep the diagnosis (and the ejection-sized penalty) a while.
    hold_seconds: float = 300.0
    penalty: float = 0.9
    critical_penalty: float = 0.9
    #: XIDs that mean the GPU (or its memory, or NVLink) is broken, not the application.
    critical_xids: tuple[int, ...] = (48, 63, 64, 74, 79, 92, 94, 95)
    #: New XIDs / uncorrected ECC errors within this window keep it open.
    event_window_seconds: float = 60.0


@dataclass(frozen=True)
class GpuThrottlingConfig(RuleConfig):
    for_seconds: float = 5.0
    penalty: float = 0.2
    critical_penalty: float = 0.4
    #: Utilisation above which the GPU counts as busy (throttling an idle GPU is normal).
    busy_utilization: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("busy_utilization", self.busy_utilization)


@dataclass(frozen=True)
class GpuIdleWithQueueConfig(RuleConfig):
    for_seconds: float = 5.0
    penalty: float = 0.3
    critical_penalty: float = 0.5
    #: Waiting requests above this ...
    min_waiting: float = 0.0
    #: ... while the backend's GPUs are below this utilisation (exit above util_exit).
    util_enter: float = 0.2
    util_exit: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("util_enter", self.util_enter)
        _unit("util_exit", self.util_exit)
        _above("util_exit", self.util_exit, "util_enter", self.util_enter)


@dataclass(frozen=True)
class IoBlockingConfig(RuleConfig):
    for_seconds: float = 3.0
    penalty: float = 0.25
    critical_penalty: float = 0.5
    #: Engine threads in uninterruptible sleep (D state).
    dstate_threads_enter: float = 2.0
    #: Host PSI io "full" avg10 as a ratio 0..1 (SPEC 3.2 base units; the kernel prints percent).
    psi_io_full_enter: float = 0.10
    psi_io_full_exit: float = 0.05
    #: Read bytes/s over the backend's baseline (and an absolute floor) with GPU utilisation dropping.
    read_factor: float = 5.0
    read_floor_bytes_per_second: float = 100e6
    #: GPU utilisation "dropping": below this fraction of its baseline.
    util_drop_fraction: float = 0.5
    rate_window_seconds: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above("psi_io_full_enter", self.psi_io_full_enter, "psi_io_full_exit", self.psi_io_full_exit)
        _unit("util_drop_fraction", self.util_drop_fraction)


@dataclass(frozen=True)
class ConntrackPressureConfig(RuleConfig):
    penalty: float = 0.0
    critical_penalty: float = 0.0
    enter: float = 0.90
    exit: float = 0.85
    critical_usage: float = 0.98

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("enter", self.enter)
        _unit("exit", self.exit)
        _above("enter", self.enter, "exit", self.exit)


@dataclass(frozen=True)
class ErrorBurstConfig(RuleConfig):
    penalty: float = 0.3
    critical_penalty: float = 0.6
    #: (server_5xx + saturated_429) / responses in the window (client quota 429s excluded).
    ratio_enter: float = 0.05
    ratio_exit: float = 0.025
    critical_ratio: float = 0.20
    window_seconds: float = 30.0
    #: Fewer responses than this in the window is too few to judge.
    min_responses: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit("ratio_enter", self.ratio_enter)
        _unit("ratio_exit", self.ratio_exit)
        _above("ratio_enter", self.ratio_enter, "ratio_exit", self.ratio_exit)


@dataclass(frozen=True)
class DiagnosisConfig:
    #: History kept per signal by the rolling windows (memory is bounded by this).
    window_seconds: float = 300.0
    #: Time constant (s) of the slow per-backend baseline EWMA.
    baseline_seconds: float = 120.0
    #: Seconds of observations before a baseline is trusted ("far above baseline" needs one).
    baseline_warmup_seconds: float = 20.0
    #: An open diagnosis whose rule has had no data this long closes (the source is gone).
    stale_seconds: float = 30.0
    #: A backend whose combined penalty reaches this is ``degraded`` (below: ``healthy``).
    degraded_penalty: float = 0.2

    backend_down: BackendDownConfig = field(default_factory=BackendDownConfig)
    engine_stalled: EngineStalledConfig = field(default_factory=EngineStalledConfig)
    kv_cache_saturation: KvCacheSaturationConfig = field(default_factory=KvCacheSaturationConfig)
    queue_avalanche: QueueAvalancheConfig = field(default_factory=QueueAvalancheConfig)
    false_healthy: FalseHealthyConfig = field(default_factory=FalseHealthyConfig)
    client_timeout_storm: ClientTimeoutStormConfig = field(default_factory=ClientTimeoutStormConfig)
    timewait_exhaustion: TimewaitExhaustionConfig = field(default_factory=TimewaitExhaustionConfig)
    connection_churn: ConnectionChurnConfig = field(default_factory=ConnectionChurnConfig)
    grpc_flow_control_stall: GrpcFlowControlStallConfig = field(default_factory=GrpcFlowControlStallConfig)
    network_degradation: NetworkDegradationConfig = field(default_factory=NetworkDegradationConfig)
    gpu_memory_pressure: GpuMemoryPressureConfig = field(default_factory=GpuMemoryPressureConfig)
    gpu_fault: GpuFaultConfig = field(default_factory=GpuFaultConfig)
    gpu_throttling: GpuThrottlingConfig = field(default_factory=GpuThrottlingConfig)
    gpu_idle_with_queue: GpuIdleWithQueueConfig = field(default_factory=GpuIdleWithQueueConfig)
    io_blocking: IoBlockingConfig = field(default_factory=IoBlockingConfig)
    conntrack_pressure: ConntrackPressureConfig = field(default_factory=ConntrackPressureConfig)
    error_burst: ErrorBurstConfig = field(default_factory=ErrorBurstConfig)

    def __post_init__(self) -> None:
        if not self.window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {self.window_seconds}")
        if not self.baseline_seconds > 0:
            raise ValueError(f"baseline_seconds must be > 0, got {self.baseline_seconds}")
        _nonneg("baseline_warmup_seconds", self.baseline_warmup_seconds)
        if not self.stale_seconds > 0:
            raise ValueError(f"stale_seconds must be > 0, got {self.stale_seconds}")
        _unit("degraded_penalty", self.degraded_penalty)

    def rule(self, kind: str) -> RuleConfig:
        """The subsection of one diagnosis kind."""
        value = getattr(self, kind, None)
        if not isinstance(value, RuleConfig):
            raise KeyError(f"no diagnosis kind {kind!r}")
        return value

    @classmethod
    def kinds(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in _GENERAL)


_GENERAL = frozenset({"window_seconds", "baseline_seconds", "baseline_warmup_seconds", "stale_seconds", "degraded_penalty"})
