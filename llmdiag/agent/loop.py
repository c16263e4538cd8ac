"""The analysis loop: one snapshot in, one immutable :class:`AgentState` out.

:class:`AgentLoop` is one tick's work, shared by ``llmdiag agent``, ``diagnose``,
``demo`` and ``top``: the analyzers observe the snapshot, the balancer takes each
backend's engine signals and combined penalty, and a new :class:`AgentState` is
built and swapped in by reference. Readers (the HTTP handlers, the agent-check
listener, the TUI) take ``loop.state`` once and read that object; it is never
mutated after it is published, so they need no lock.

:func:`analyze` runs a whole stream of snapshots through an analyzer (or a loop)
and keeps every diagnosis episode: the ``diagnose`` report.

``AgentState.to_json()`` is the ``llmdiag.state/v1`` document served at
``GET /v1/state``::

    {"schema": "llmdiag.state/v1", "ts": 1733140000.0, "host": "gpu-node-7",
     "snapshot": {... llmdiag.snapshot/v1 ...} | null,
     "open": [Diagnosis, ...], "closed": [Diagnosis + {"open": false, "closed_at", "enforced"}, ...],
     "backends": {"vllm-0": {"name", "address", "score", "penalty", "weight_percent", "state",
                             "reasons": [...], "labels": {"pod", ...} (only when known),
                             "cooling_until": null, "ejected_until": null}},
     "collectors": {"engine": {"status", "reason", "last_ok_ts", "errors_total"}},
     "ticks": 42, "last_tick_seconds": 0.004}

``AgentState.from_json(state.to_json()) == state``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmdiag.analyzers import AnalysisResult, Analyzer, BackendHealth
from llmdiag.config import Config
from llmdiag.exporters.penalties import backend_entries, penalties_document
from llmdiag.model import (
    Backend,
    BackendPenalty,
    BackendState,
    CollectorStatus,
    Diagnosis,
    PenaltiesDocument,
    Reason,
    Severity,
    Snapshot,
)
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["STATE_SCHEMA", "AgentBackend", "AgentLoop", "AgentState", "DiagnoseReport", "Episode", "analyze"]

STATE_SCHEMA = "llmdiag.state/v1"


@dataclass(frozen=True, slots=True)
class Episode:
    """One diagnosis from opening to closing (or to the end of the run)."""

    diagnosis: Diagnosis
    closed_at: float | None
    enforced: bool

    def to_json(self) -> dict[str, Any]:
        return {**self.diagnosis.to_json(), "open": self.closed_at is None, "closed_at": self.closed_at, "enforced": self.enforced}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Episode:
        closed_at = obj.get("closed_at")
        return cls(Diagnosis.from_json(obj), None if closed_at is None else float(closed_at), bool(obj.get("enforced", True)))


@dataclass
class DiagnoseReport:
    """Every episode of a run, the final health per backend and the collectors' last status."""

    episodes: list[Episode] = field(default_factory=list)
    backends: dict[str, BackendHealth] = field(default_factory=dict)
    collectors: dict[str, CollectorStatus] = field(default_factory=dict)
    first_ts: float | None = None
    last_ts: float | None = None
    snapshots: int = 0
    source: str = ""

    @property
    def worst(self) -> Severity | None:
        sev = [e.diagnosis.severity for e in self.episodes]
        return max(sev, key=lambda s: s.rank) if sev else None

    def exit_code(self) -> int:
        """0 healthy (nothing above info), 1 warning, 2 critical."""
        worst = self.worst
        if worst is Severity.CRITICAL:
            return 2
        if worst is Severity.WARNING:
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "diagnoses": [e.to_json() for e in self.episodes],
            "backends": {name: h.to_json() for name, h in sorted(self.backends.items())},
        }


@dataclass(frozen=True, slots=True)
class AgentBackend:
    """One backend as the agent sees it: the penalties entry plus the balancer's deadlines.

    ``cooling_until`` and ``ejected_until`` are epoch seconds (the snapshots' time), ``None`` while
    the backend is not cooling (not ejected) and for backends the balancer does not know. ``labels``
    are its Kubernetes labels (pod, namespace, container, node) when known.
    """

    name: str
    address: str
    score: float
    penalty: float
    weight_percent: int
    state: BackendState
    reasons: tuple[Reason, ...] = ()
    cooling_until: float | None = None
    ejected_until: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_penalty(cls, p: BackendPenalty, cooling_until: float | None = None,
                     ejected_until: float | None = None) -> AgentBackend:
        return cls(p.name, p.address, p.score, p.penalty, p.weight_percent, BackendState(p.state), tuple(p.reasons),
                   cooling_until, ejected_until, dict(p.labels))

    def as_penalty(self) -> BackendPenalty:
        return BackendPenalty(self.name, self.address, self.score, self.penalty, self.weight_percent, self.state,
                              self.reasons, dict(self.labels))

    def to_json(self) -> dict[str, Any]:
        return {**self.as_penalty().to_json(), "cooling_until": self.cooling_until, "ejected_until": self.ejected_until}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> AgentBackend:
        cooling, ejected = obj.get("cooling_until"), obj.get("ejected_until")
        return cls.from_penalty(BackendPenalty.from_json(obj), None if cooling is None else float(cooling),
                                None if ejected is None else float(ejected))


@dataclass(frozen=True)
class AgentState:
    """What the agent knows after one tick; published by reference, never mutated afterwards."""

    ts: float
    host: str
    snapshot: Snapshot | None = None
    open: tuple[Diagnosis, ...] = ()
    closed: tuple[Episode, ...] = ()  # most recent last
    backends: Mapping[str, AgentBackend] = field(default_factory=dict)
    collectors: Mapping[str, CollectorStatus] = field(default_factory=dict)
    ticks: int = 0
    last_tick_seconds: float | None = None

    def penalties(self, ttl_seconds: float = 5) -> PenaltiesDocument:
        """The ``llmdiag.penalties/v1`` document of this state."""
        return penalties_document(self.ts, self.host, ttl_seconds=ttl_seconds,
                                  balancer_states=[b.as_penalty() for b in self.backends.values()])

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "ts": self.ts,
            "host": self.host,
            "snapshot": None if self.snapshot is None else self.snapshot.to_json(),
            "open": [d.to_json() for d in self.open],
            "closed": [e.to_json() for e in self.closed],
            "backends": {name: b.to_json() for name, b in sorted(self.backends.items())},
            "collectors": {name: c.to_json() for name, c in sorted(self.collectors.items())},
            "ticks": self.ticks,
            "last_tick_seconds": self.last_tick_seconds,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> AgentState:
        """Parse a ``llmdiag.state/v1`` document; ``ValueError`` for anything else."""
        if not isinstance(obj, Mapping) or obj.get("schema") != STATE_SCHEMA:
            got = obj.get("schema") if isinstance(obj, Mapping) else type(obj).__name__
            raise ValueError(f"not a {STATE_SCHEMA} document (schema {got!r})")
        try:
            snap = obj.get("snapshot")
            last = obj.get("last_tick_seconds")
            return cls(
                ts=float(obj["ts"]),
                host=str(obj.get("host", "")),
                snapshot=None if snap is None else Snapshot.from_json(snap),
                open=tuple(Diagnosis.from_json(d) for d in obj.get("open", ())),
                closed=tuple(Episode.from_json(e) for e in obj.get("closed", ())),
                backends={name: AgentBackend.from_json(b) for name, b in obj.get("backends", {}).items()},
                collectors={name: CollectorStatus.from_json(c) for name, c in obj.get("collectors", {}).items()},
                ticks=int(obj.get("ticks", 0)),
                last_tick_seconds=None if last is None else float(last),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed {STATE_SCHEMA} document: {type(exc).__name__}: {exc}") from None


class AgentLoop:
    """One tick's work: ``observe(snapshot) -> AgentState``.

    ``analyzer.observe`` -> ``balancer.update_signals`` / ``set_penalty`` for each backend the
    balancer knows -> a new :class:`AgentState`, swapped in by reference. ``observe`` is meant to
    be called from one thread (the tick thread); ``state`` may be read from any thread.

    Without a ``balancer`` argument the loop makes one on first use that runs on tick time (the
    latest snapshot's ``ts``; ``clock()`` before the first one), so its warm-up ramp and smoothing
    advance with the snapshots: a replay gives the same scores as the live run it recorded.
    Backends that only a snapshot names (a replayed recording) are reported from the analyzer's
    health with the default score, never added to the balancer.
    """

    def __init__(
        self,
        config: Config,
        backends: Iterable[Backend],
        *,
        balancer: Balancer | None = None,
        clock: Callable[[], float] = time.time,
        keep_closed: int = 100,
    ) -> None:
        self.config = config
        self.backends = list(backends)
        self._addresses, self._labels = _backend_tables(self.backends)
        self.analyzer = Analyzer(config, backends=self.backends)
        self.clock = clock
        self._now: float | None = None
        self._balancer = balancer
        self.last_result: AnalysisResult | None = None
        self._closed: deque[Episode] = deque(maxlen=max(0, keep_closed))
        self._ticks = 0
        self._write_lock = threading.Lock()
        self._state = AgentState(ts=clock(), host=config.agent.hostname)

    @property
    def state(self) -> AgentState:
        return self._state

    def tick_time(self) -> float:
        """The time of the latest snapshot (``clock()`` before the first one)."""
        return self.clock() if self._now is None else self._now

    @property
    def balancer(self) -> Balancer:
        if self._balancer is None:
            self._balancer = Balancer(self.backends, self.config.balancer, clock=self.tick_time)
        return self._balancer

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """A new backend set (discovery, config): known names keep their balancer state."""
        with self._write_lock:
            self.backends = list(backends)
            self._addresses, self._labels = _backend_tables(self.backends)
            self.balancer.set_backends(self.backends)

    def mark_restarted(self, name: str) -> None:
        """The engine behind ``name`` restarted (new pid): its score ramps up again."""
        self.balancer.mark_restarted(name)

    def observe(self, snap: Snapshot, collect_seconds: float = 0.0) -> AgentState:
        """Analyze one snapshot, feed the balancer, publish and return the new state.

        ``collect_seconds`` is how long the collectors took for this snapshot; the state's
        ``last_tick_seconds`` is that plus the analysis."""
        started = time.perf_counter()
        with self._write_lock:
            self._now = snap.ts if self._now is None else max(self._now, snap.ts)
            result = self.analyzer.observe(snap)
            self.last_result = result
            known = {b.name for b in self.balancer.backends}
            for name, signals in snap.backends.items():
                if name in known:
                    self.balancer.update_signals(name, signals)
            for name, health in result.backends.items():
                if name in known:
                    self.balancer.set_penalty(name, health.penalty, health.reasons)
            enforced = self.analyzer.enforced
            self._closed.extend(Episode(d, result.ts, enforced.get(d.kind, True)) for d in result.closed)
            self._ticks += 1
            entries = backend_entries(result.backends, self._addresses, self.balancer.snapshot_states(), self._labels)
            deadlines = self._wall_deadlines(snap.ts)
            self._state = AgentState(
                ts=snap.ts,
                host=snap.hostname or self.config.agent.hostname,
                snapshot=snap,
                open=result.open,
                closed=tuple(self._closed),
                backends={e.name: AgentBackend.from_penalty(e, *deadlines.get(e.name, (None, None))) for e in entries},
                collectors=dict(snap.collectors),
                ticks=self._ticks,
                last_tick_seconds=collect_seconds + (time.perf_counter() - started),
            )
            return self._state

    def _wall_deadlines(self, now: float) -> dict[str, tuple[float | None, float | None]]:
        """The balancer's cooling and ejection deadlines in the snapshots' time (epoch seconds).

        The loop's own balancer runs on tick time, so the offset is 0; a balancer given to the
        constructor may run on ``time.monotonic``: its deadlines move by the offset between its
        clock and ``now`` (the snapshot's time), both read here, within the same tick.
        """
        offset = now - self.balancer.clock()
        return {name: (None if d.cooling_until is None else d.cooling_until + offset,
                       None if d.ejected_until is None else d.ejected_until + offset)
                for name, d in self.balancer.deadlines().items()}


def _backend_tables(backends: list[Backend]) -> tuple[dict[str, str], dict[str, Mapping[str, str]]]:
    """Address and labels by backend name: built when the backend set changes, not every tick
    (``Backend.address`` parses the URL on every call)."""
    return {b.name: b.address for b in backends}, {b.name: b.labels for b in backends if b.labels}


def analyze(snapshots: Iterable[Snapshot], analyzer: Analyzer | AgentLoop, source: str = "") -> DiagnoseReport:
    """Run the analyzer (or a whole loop) over snapshots; collect every episode and the final backend health."""
    report = DiagnoseReport(source=source)
    current: dict[tuple[str, str, float], Diagnosis] = {}
    closed: list[Episode] = []
    plain = analyzer.analyzer if isinstance(analyzer, AgentLoop) else analyzer
    for snap in snapshots:
        if isinstance(analyzer, AgentLoop):
            analyzer.observe(snap)
            result = analyzer.last_result
            assert result is not None
        else:
            result = analyzer.observe(snap)
        report.snapshots += 1
        report.first_ts = snap.ts if report.first_ts is None else report.first_ts
        report.last_ts = snap.ts
        report.collectors.update(snap.collectors)
        report.backends = result.backends
        for d in result.closed:
            current.pop((d.kind, d.backend, d.since), None)
            closed.append(Episode(d, result.ts, plain.enforced.get(d.kind, True)))
        for d in result.open:
            current[(d.kind, d.backend, d.since)] = d
    episodes = closed + [Episode(d, None, plain.enforced.get(d.kind, True)) for d in current.values()]
    episodes.sort(key=lambda e: (e.diagnosis.backend == "host", e.diagnosis.backend, e.diagnosis.since, e.diagnosis.kind))
    report.episodes = episodes
    return report
