"""What the TUI shows, computed from the ticks: rows, rates and history (no Textual here).

:class:`TopModel` ingests one :class:`~llmdiag.agent.loop.AgentState` per
tick and keeps the recent states, from which it computes the numbers that get a
sparkline, the per-second rates of the counters the fleet view shows
(RST_STREAM/s, retransmits/s), and a log of every diagnosis that opened or
closed. The screens only format what this model holds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


class TopModel:
    """Everything the screens show, updated once per tick by :meth:`ingest`.

    Cheap per tick whatever the fleet size: it keeps references to the last
    :data:`HISTORY` states (which exist anyway) and computes a series only when
    a screen asks for it (:meth:`series`), plus the two per-second rates the
    fleet view shows for every backend.
    """

    #: counters shown as per-second rates in the fleet view: column -> signal
    RATES = {"rst_per_s": "h2_rst_stream_total", "retrans_per_s": "tcp_retransmits_total"}
    RATE_TICKS = 5

    def __init__(self) -> None:
        self.state: AgentState | None = None
        self.ticks = 0
        self.states: deque[AgentState] = deque(maxlen=HISTORY)
        self.log: deque[LogEntry] = deque(maxlen=1000)
        self._rates: dict[tuple[str, str], float | None] = {}

    # -- ingest ------------------------------------------------------------------
    def ingest(self, state: AgentState, opened: Iterable[Diagnosis] = (), closed: Iterable[Diagnosis] = ()) -> None:
        """One tick; ``opened``/``closed`` are the diagnoses that changed since the last one."""
        self.state = state
        self.states.append(state)
        # Rates over the last RATE_TICKS ticks: steadier than tick-to-tick (a counter growing 0.2/s
        # reads 0.2, not 0 and 1 in turn), and a row that does not change is not redrawn.
        earlier = list(self.states)[-(self.RATE_TICKS + 1):-1]
        previous = next((s.snapshot for s in earlier if s.snapshot is not None), None)
        self.ticks += 1
        for d in opened:
            self.log.append(LogEntry(state.ts, "opened", d))
        for d in closed:
            self.log.append(LogEntry(state.ts, "closed", d))
        snap = state.snapshot
        self._rates = {}
        if snap is not None and previous is not None:
            for name, signals in snap.backends.items():
                before = previous.backends.get(name)
                if before is None:
                    continue
                for column, signal in self.RATES.items():
                    self._rates[(name, column)] = _rate(number(before.get(signal)), number(signals.get(signal)),
                                                        snap.ts - previous.ts)

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

    # -- queries -------------------------------------------------------------------
    def series(self, subject: str, key: str, last: int = HISTORY) -> list[float | None]:
        """The last ``last`` values of one series, oldest first, computed from the kept states.

        ``subject`` is a backend name (``key``: ``score``, ``penalty``, a signal, ``signal.p50``
        or ``signal.p99`` of a distribution; a ``*_total`` counter comes out as a per-second
        rate) or ``"host"`` (``key``: a host signal)."""
        states = list(self.states)[-(last + 1):]
        out: list[float | None] = []
        prev: tuple[float, float | None] | None = None
        for state in states:
            snap = state.snapshot
            if key in ("score", "penalty"):
                routing = state.backends.get(subject)
                value = None if routing is None else float(getattr(routing, key))
            elif snap is None:
                value = None
            else:
                signals = snap.host if subject == "host" else snap.backends.get(subject, {})
                name, _, stat = key.partition(".")
                value = number(signals.get(name), stat or "ewma")
                if name.endswith("_total"):  # one state more than asked for primes the first rate
                    raw = value
                    value = None if prev is None else _rate(prev[1], raw, state.ts - prev[0])
                    prev = (state.ts, raw)
            out.append(value)
        return out[-last:]

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


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """Per-second increase; unknown on a gap, a zero interval or a counter reset."""
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
