"""What the TUI shows, computed from the ticks: rows, rates and history (no Textual here).

:class:`TopModel` ingests one :class:`~llmdiag.agent.loop.AgentState` per
tick and keeps, per backend, a short history of the numbers that get a
sparkline, the per-second rates of the counters the fleet view shows
(RST_STREAM/s, retransmits/s), and a log of every diagnosis that opened or
closed. The screens only format what this model holds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmdiag.agent.loop import AgentBackend, AgentState
from llmdiag.analyzers.context import gpus_from_processes
from llmdiag.model import Diagnosis, Distribution, Labelled, Severity, Snapshot

__all__ = ["FleetRow", "LogEntry", "TopModel", "fmt", "number", "sparkline"]

HISTORY = 120  # ticks of history per series (two minutes at the default 1 s tick)
_BARS = "▁▂▃▄▅▆▇█"


def number(value: Any, stat: str = "ewma") -> float | None:
    """A signal as a plain finite number (distribution -> ``stat``, labelled -> total); None when unknown."""
    if isinstance(value, Distribution):
        value = getattr(value, stat)
    elif isinstance(value, Labelled):
        value = value.total() if value else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    """A number for a cell; ``-`` when unknown (never a made-up zero)."""
    if value is None or not math.isfinite(value):
        return "-"
    if spec == "%":
        return f"{value * 100:.0f}%"
    return f"{value:{spec}}{unit}"


def sparkline(values: Iterable[float | None], width: int = 10, lo: float | None = None, hi: float | None = None) -> str:
    """The last ``width`` values as block characters; gaps (unknown) as spaces. ``lo``/``hi`` fix the scale."""
    points = list(values)[-width:]
    known = [v for v in points if v is not None and math.isfinite(v)]
    if not known:
        return " " * len(points)
    low = min(known) if lo is None else lo
    high = max(known) if hi is None else hi
    span = high - low
    out = []
    for v in points:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif span <= 0:
            out.append(_BARS[0] if lo is not None and v <= low else _BARS[len(_BARS) // 2])
        else:
            i = int((min(max(v, low), high) - low) / span * (len(_BARS) - 1) + 0.5)
            out.append(_BARS[i])
    return "".join(out)


@dataclass(frozen=True, slots=True)
class FleetRow:
    """One backend's line in the fleet view."""

    name: str
    state: str
    score: float | None
    penalty: float | None
    weight_percent: int | None
    ttft_p50: float | None
    ttft_p99: float | None
    waiting: float | None
    kv: float | None
    gpu_util: float | None
    gpu_mem: float | None
    timewait: float | None
    rst_per_s: float | None
    retrans_per_s: float | None
    diagnosis: str
    severity: Severity | None
    up: bool | None

    #: sort keys the fleet view offers, in the order `s` cycles through them
    SORT_KEYS = ("score", "name", "penalty", "ttft_p99", "waiting", "kv", "timewait", "rst_per_s")

    def sort_value(self, key: str) -> tuple[int, Any]:
        """Unknown values sort last whatever the direction."""
        value = getattr(self, key)
        return (1, 0) if value is None else (0, value)


@dataclass(frozen=True, slots=True)
class LogEntry:
    ts: float
    event: str  # "opened" | "closed"
    diagnosis: Diagnosis


@dataclass
class _Series:
    values: deque[float | None] = field(default_factory=lambda: deque(maxlen=HISTORY))


class TopModel:
    """Everything the screens show, updated once per tick by :meth:`ingest`."""

    #: counters shown as per-second rates: column -> signal
    RATES = {"rst_per_s": "h2_rst_stream_total", "retrans_per_s": "tcp_retransmits_total"}

    def __init__(self) -> None:
        self.state: AgentState | None = None
        self.ticks = 0
        self.history: dict[tuple[str, str], deque[float | None]] = {}
        self.log: deque[LogEntry] = deque(maxlen=1000)
        self._prev: dict[tuple[str, str], tuple[float, float]] = {}  # (backend, signal) -> (ts, value)
        self._rates: dict[tuple[str, str], float | None] = {}

    # -- ingest ------------------------------------------------------------------
    def ingest(self, state: AgentState, opened: Iterable[Diagnosis] = (), closed: Iterable[Diagnosis] = ()) -> None:
        """One tick; ``opened``/``closed`` are the diagnoses that changed since the last one."""
        self.state = state
        self.ticks += 1
        for d in opened:
            self.log.append(LogEntry(state.ts, "opened", d))
        for d in closed:
            self.log.append(LogEntry(state.ts, "closed", d))
        snap = self.snapshot
        for name in self.backend_names():
            signals = snap.backends.get(name, {})
            values = self._series_values(name, signals, state.backends.get(name))
            for key, value in values.items():
                self._push((name, key), value)
            for column, signal in self.RATES.items():
                self._rates[(name, column)] = values.get(signal)
        for key, value in (("psi_io_full_avg10", number(snap.host.get("psi_io_full_avg10"))),
                           ("sockstat_tcp_tw", number(snap.host.get("sockstat_tcp_tw")))):
            self._push(("host", key), value)

    @property
    def snapshot(self) -> Snapshot:
        """The latest snapshot (an empty one before the first, or when the agent has none yet)."""
        if self.state is None or self.state.snapshot is None:
            return Snapshot(ts=0.0)
        return self.state.snapshot

    def backend_names(self) -> list[str]:
        if self.state is None:
            return []
        return sorted(set(self.snapshot.backends) | set(self.state.backends))

    def open_for(self, backend: str) -> list[Diagnosis]:
        """The backend's open diagnoses, worst first."""
        found = [d for d in self.state.open if d.backend == backend] if self.state else []
        found.sort(key=lambda d: (-d.severity.rank, -d.penalty, d.kind))
        return found

    def _push(self, key: tuple[str, str], value: float | None) -> None:
        series = self.history.get(key)
        if series is None:
            series = self.history[key] = deque(maxlen=HISTORY)
        series.append(value)

    def _rate(self, backend: str, signal: str, ts: float, value: float | None) -> float | None:
        prev = self._prev.get((backend, signal))
        if value is None:
            return None
        self._prev[(backend, signal)] = (ts, value)
        if prev is None or ts <= prev[0] or value < prev[1]:  # first sight or counter reset
            return None
        return (value - prev[1]) / (ts - prev[0])

    def _series_values(self, name: str, signals: Mapping[str, Any], routing: AgentBackend | None) -> dict[str, float | None]:
        out: dict[str, float | None] = {
            "score": routing.score if routing else None,
            "penalty": routing.penalty if routing else None,
        }
        ts = self.state.ts if self.state is not None else 0.0
        for signal, value in signals.items():
            if isinstance(value, Distribution):
                out[f"{signal}.p50"] = number(value, "p50")
                out[f"{signal}.p99"] = number(value, "p99")
            elif signal.endswith("_total"):
                out[signal] = self._rate(name, signal, ts, number(value))  # counters as per-second rates
            else:
                out[signal] = number(value)
        return out

    # -- queries -------------------------------------------------------------------
    def series(self, subject: str, key: str) -> list[float | None]:
        return list(self.history.get((subject, key), ()))

    def rate(self, backend: str, column: str) -> float | None:
        return self._rates.get((backend, column))

    def gpus_of(self, backend: str) -> tuple[str, ...]:
        return gpus_from_processes(self.snapshot.backends.get(backend, {}))

    def destination_of(self, backend: str) -> str | None:
        routing = self.state.backends.get(backend) if self.state else None
        if routing is not None and routing.address in self.snapshot.destinations:
            return routing.address
        return None

    def rows(self) -> list[FleetRow]:
        state = self.state
        if state is None:
            return []
        snap = self.snapshot
        rows = []
        for name in self.backend_names():
            s = snap.backends.get(name, {})
            routing = state.backends.get(name)
            top = self.open_for(name)
            utils = [number(snap.gpus.get(g, {}).get("gpu_utilization")) for g in self.gpus_of(name)]
            mems = []
            for g in self.gpus_of(name):
                gs = snap.gpus.get(g, {})
                used, total = number(gs.get("memory_used_bytes")), number(gs.get("memory_total_bytes"))
                mems.append(used / total if used is not None and total else None)
            dest = self.destination_of(name)
            up = number(s.get("up"))
            rows.append(FleetRow(
                name=name,
                state=routing.state.value if routing else "-",
                score=routing.score if routing else None,
                penalty=routing.penalty if routing else None,
                weight_percent=routing.weight_percent if routing else None,
                ttft_p50=number(s.get("ttft_seconds"), "p50"),
                ttft_p99=number(s.get("ttft_seconds"), "p99"),
                waiting=number(s.get("requests_waiting")),
                kv=number(s.get("kv_cache_usage")),
                gpu_util=_max(utils),
                gpu_mem=_max(mems),
                timewait=number(snap.destinations[dest].get("timewait_sockets")) if dest else None,
                rst_per_s=self.rate(name, "rst_per_s"),
                retrans_per_s=self.rate(name, "retrans_per_s"),
                diagnosis=top[0].kind + (f" +{len(top) - 1}" if len(top) > 1 else "") if top else "",
                severity=top[0].severity if top else None,
                up=None if up is None else up >= 1,
            ))
        return rows


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
