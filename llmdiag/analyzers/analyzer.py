"""The analyzer: snapshots in, diagnoses with evidence and per-backend penalties out.

API (what the agent, ``llmdiag diagnose`` and the TUI use)::

    analyzer = Analyzer(config, backends=None)   # Config or DiagnosisConfig; Backend list (addresses, GPU override)
    result = analyzer.observe(snapshot)          # -> AnalysisResult, once per tick
    result.open        # diagnoses open after this tick (tuple[Diagnosis])
    result.opened      # opened this tick
    result.closed      # closed this tick (their last state)
    result.backends    # name -> BackendHealth(penalty, state, reasons)
    analyzer.open_diagnoses()
    analyzer.detected_total, analyzer.enforced_total   # kind -> openings counted

Time is the snapshot's ``ts``, never the wall clock, so a replayed recording
gives exactly the diagnoses the live run gave over the same snapshots. A
snapshot older than the previous one is ignored.

Each tick: every numeric signal whose history an enabled rule reads (its
``Rule.history``) goes into the rolling windows, the rest only into the
snapshot the rules read current values from; each enabled rule yields a
verdict per subject; a per-(kind, subject, key) state machine applies
hysteresis:

* closed -> open when ``enter`` has held continuously ``for_seconds``
  (``since`` is when it started holding);
* open -> closed when ``stay`` fails and the diagnosis has been open
  ``hold_seconds``;
* a tick without data for the subject (verdict ``None``: scrape gap, engine
  down) changes nothing, except that an open diagnosis whose rule has had no
  data for ``stale_seconds`` closes.

Baselines are updated after the rules ran, and not for a subject with an
open or pending diagnosis (so overload never becomes the baseline).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmdiag.analyzers.baseline import Baselines
from llmdiag.analyzers.context import Context, gpus_from_processes, history_name
from llmdiag.analyzers.penalties import BackendHealth, backend_health
from llmdiag.analyzers.rules import RULES, Finding, Rule
from llmdiag.analyzers.windows import Series, WindowStore, is_counter
from llmdiag.collectors.timewait import backend_destination
from llmdiag.config import Config
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import Backend, Diagnosis, Distribution, Labelled, Signals, Snapshot

__all__ = ["AnalysisResult", "Analyzer"]

log = logging.getLogger("llmdiag.analyzers")

_DIST_FIELDS = ("p50", "p99", "ewma")


@dataclass(frozen=True, slots=True)
class AnalysisResult:
    ts: float
    open: tuple[Diagnosis, ...]
    opened: tuple[Diagnosis, ...]
    closed: tuple[Diagnosis, ...]
    backends: dict[str, BackendHealth]


@dataclass(slots=True)
class _Track:
    pending_since: float | None = None
    opened_at: float | None = None
    last_data_ts: float = 0.0
    diagnosis: Diagnosis | None = None


@dataclass(slots=True)
class _Counts:
    detected: dict[str, int] = field(default_factory=dict)
    enforced: dict[str, int] = field(default_factory=dict)


class Analyzer:
    def __init__(self, config: Config | DiagnosisConfig | None = None, backends: Iterable[Backend] | None = None) -> None:
        if isinstance(config, Config):
            diag = config.diagnosis
            if backends is None:
                backends = config.backend_list()
        else:
            diag = config or DiagnosisConfig()
        self.config: DiagnosisConfig = diag
        known = list(backends or ())
        # Backend.gpus is an override (config/discovery); without it the GPUs come from the gpu
        # collector's per-backend process_memory_bytes{gpu,pid}: GPU -> the backends last seen
        # holding memory on it, so a GPU that falls off the bus (and so out of NVML's process
        # list) stays its backend's until another backend's processes show up on it.
        self._gpus_by_backend = {b.name: tuple(str(g) for g in b.gpus) for b in known if b.gpus}
        self._gpu_holders: dict[str, frozenset[str]] = {}
        # The same ip:port key the timewait and tcp collectors use (host names resolved once).
        self._destination_of = {b.name: backend_destination(b) for b in known}
        self.rules: list[Rule] = [cls(diag.rule(kind)) for kind, cls in RULES.items() if diag.rule(kind).enabled]
        self.enforced = {kind: diag.rule(kind).enforce for kind in RULES}
        #: The ``scope/signal`` entries whose history some enabled rule reads (Rule.history): the only
        #: ones recorded. By scope: the declared names (families and single fields) and their families.
        self.history: frozenset[str] = frozenset().union(*(rule.history for rule in self.rules))
        self._declared: dict[str, set[str]] = {}
        self._families: dict[str, set[str]] = {}
        for entry in self.history:
            scope, _, signal = entry.partition("/")
            self._declared.setdefault(scope, set()).add(signal)
            self._families.setdefault(scope, set()).add(history_name(signal))
        self.windows = WindowStore(diag.window_seconds)
        self._series_of: dict[tuple[str, str], dict[object, Series]] = {}
        self._sweeps_seen = self.windows.sweeps
        self.baselines = Baselines(diag.baseline_seconds, diag.baseline_warmup_seconds)
        self._tracks: dict[tuple[str, str, str], _Track] = {}
        self._counts = _Counts()
        self._last_ts: float | None = None
        self._last_prune = float("-inf")
        self._last: AnalysisResult | None = None

    # -- public ------------------------------------------------------------
    @property
    def detected_total(self) -> dict[str, int]:
        return dict(self._counts.detected)

    @property
    def enforced_total(self) -> dict[str, int]:
        return dict(self._counts.enforced)

    def open_diagnoses(self) -> list[Diagnosis]:
        return [t.diagnosis for _, t in sorted(self._tracks.items()) if t.opened_at is not None and t.diagnosis]

    def observe(self, snapshot: Snapshot) -> AnalysisResult:
        now = snapshot.ts
        if self._last_ts is not None and now <= self._last_ts and self._last is not None:
            return self._last
        self._last_ts = now
        self._record(snapshot)
        self.windows.advance(now)
        ctx = Context(snapshot, self.windows, self.baselines, self.config, self._gpu_map(snapshot), self._destination_of)
        frozen = {subject for (_, subject, _), t in self._tracks.items() if t.opened_at is not None or t.pending_since is not None}
        opened: list[Diagnosis] = []
        closed: list[Diagnosis] = []
        seen: set[tuple[str, str, str]] = set()
        for rule in self.rules:
            cfg = rule.config
            ctx.history = rule.history  # only what this rule declares (see Rule.history)
            for subject, key, finding in rule.evaluate(ctx):
                ident = (rule.kind, subject, key)
                if ident in seen:
                    continue
                seen.add(ident)
                track = self._tracks.get(ident)
                if track is None:
                    if finding is None or not finding.enter:
                        continue  # nothing to remember
                    track = self._tracks[ident] = _Track()
                self._step(rule, cfg.for_seconds, cfg.hold_seconds, ident, track, finding, now, opened, closed)
        if ctx.undeclared:
            self._record_also(ctx.undeclared)
        for ident, track in list(self._tracks.items()):
            if ident not in seen:
                self._step(None, 0.0, 0.0, ident, track, None, now, opened, closed)
        # Also freeze subjects whose diagnosis became pending this tick: the first overloaded tick stays out too.
        frozen.update(subject for (_, subject, _) in self._tracks)
        for subject, key, value in ctx.baseline_updates:
            if subject not in frozen:
                self.baselines.update(key, now, value)
        if now - self._last_prune >= self.config.window_seconds:
            # Bounded memory in a long-running agent: baselines of backends gone for a whole window.
            self._last_prune = now
            self.baselines.prune(now - self.config.window_seconds)
        open_now = self.open_diagnoses()
        health = backend_health(snapshot.backends, open_now, self.enforced, self.config.degraded_penalty)
        self._last = AnalysisResult(now, tuple(open_now), tuple(opened), tuple(closed), health)
        return self._last

    # -- internals -----------------------------------------------------------
    def _record_also(self, entries: set[str]) -> None:
        """Start recording history a rule read without declaring it (see ``context.STRICT_HISTORY``)."""
        new = entries - self.history
        if not new:
            return
        log.error("a rule read history it does not declare in Rule.history: %s; recording it from now on "
                  "(a bug in the rule: please report it)", ", ".join(sorted(new)))
        self.history = self.history | new
        for entry in new:
            scope, _, family = entry.partition("/")
            self._declared.setdefault(scope, set()).add(family)
            self._families.setdefault(scope, set()).add(family)

    def _gpu_map(self, snapshot: Snapshot) -> dict[str, tuple[str, ...]]:
        """Backend -> GPU indices: Backend.gpus where given, else the GPUs its processes were
        last seen on (gpu collector's backend-scope process_memory_bytes{gpu,pid})."""
        claims: dict[str, set[str]] = {}
        for name, signals in snapshot.backends.items():
            for gpu in gpus_from_processes(signals):
                claims.setdefault(gpu, set()).add(name)
        for gpu, names in claims.items():
            self._gpu_holders[gpu] = frozenset(names)
        derived: dict[str, list[str]] = {}
        for gpu in sorted(self._gpu_holders, key=lambda g: (len(g), g)):
            for name in self._gpu_holders[gpu]:
                derived.setdefault(name, []).append(gpu)
        return {**{b: tuple(gs) for b, gs in derived.items()}, **self._gpus_by_backend}

    def _step(
        self,
        rule: Rule | None,
        for_seconds: float,
        hold_seconds: float,
        ident: tuple[str, str, str],
        track: _Track,
        finding: Finding | None,
        now: float,
        opened: list[Diagnosis],
        closed: list[Diagnosis],
    ) -> None:
        kind, subject, _ = ident
        if finding is None:
            # No data: freeze, unless the source has been gone for too long.
            if track.opened_at is not None and now - track.last_data_ts >= self.config.stale_seconds:
                closed.append(track.diagnosis)  # type: ignore[arg-type]
                del self._tracks[ident]
            elif track.opened_at is None and now - track.last_data_ts >= self.config.stale_seconds:
                del self._tracks[ident]
            return
        track.last_data_ts = now
        if track.opened_at is None:
            if not finding.enter:
                del self._tracks[ident]
                return
            if track.pending_since is None:
                track.pending_since = now
            if now - track.pending_since >= for_seconds:
                track.opened_at = now
                track.diagnosis = self._diagnosis(rule, subject, track.pending_since, finding)
                opened.append(track.diagnosis)
                self._counts.detected[kind] = self._counts.detected.get(kind, 0) + 1
                if self.enforced.get(kind, True):
                    self._counts.enforced[kind] = self._counts.enforced.get(kind, 0) + 1
            return
        if finding.stay:
            track.diagnosis = self._diagnosis(rule, subject, track.diagnosis.since, finding)  # type: ignore[union-attr]
        elif now - track.opened_at >= hold_seconds:
            closed.append(track.diagnosis)  # type: ignore[arg-type]
            del self._tracks[ident]

    @staticmethod
    def _diagnosis(rule: Rule | None, subject: str, since: float, finding: Finding) -> Diagnosis:
        assert rule is not None
        return Diagnosis(
            kind=rule.kind,
            backend=subject,
            severity=finding.severity,
            confidence=finding.confidence,
            since=since,
            summary=finding.summary,
            evidence=finding.evidence,
            remediation=rule.remediation,
            penalty=finding.penalty,
        )

    def _record(self, snap: Snapshot) -> None:
        ts = snap.ts
        self._record_signals("h", "", snap.host, ts)
        for dest, signals in snap.destinations.items():
            self._record_signals("d", dest, signals, ts)
        for name, signals in snap.backends.items():
            self._record_signals("b", name, signals, ts)
        for name, engines in snap.engines.items():
            for label, signals in engines.items():
                self._record_signals("e", f"{name}/{label}", signals, ts)
        for index, signals in snap.gpus.items():
            self._record_signals("g", index, signals, ts)

    def _record_signals(self, scope: str, subject: str, signals: Signals, ts: float) -> None:
        history = self._families.get(scope)
        if not history:
            return  # no rule reads this scope's history (destinations, the host)
        windows = self.windows
        if windows.sweeps != self._sweeps_seen:
            # The store forgot idle series: drop every kept reference (they are found again below).
            self._series_of.clear()
            self._sweeps_seen = windows.sweeps
        # The subject's Series objects by signal (and (signal, ".", field) / (signal, "{", label)): the keys
        # are built once, not a few thousand strings a tick at 64 backends.
        known = self._series_of.get((scope, subject))
        if known is None:
            known = self._series_of[(scope, subject)] = {}
        prefix = f"{scope}/{subject}/"
        declared = self._declared.get(scope, ())
        for name, value in signals.items():
            if name not in history:
                continue  # not read by any rule (most signals: no point keeping their windows)
            kind = type(value)
            if kind is float or kind is int:  # most values: the branch below, without its isinstance tests
                if value == value:
                    series = known.get(name)
                    if series is None:
                        series = known[name] = windows.series_for(prefix + name)
                    series.append(ts, float(value))
                continue
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                if value == value:  # NaN/NA is "unknown": no point
                    series = known.get(name)
                    if series is None:
                        series = known[name] = windows.series_for(prefix + name)
                    series.append(ts, float(value))
            elif isinstance(value, Distribution):
                whole = name in declared
                for f in _DIST_FIELDS:
                    v = getattr(value, f)
                    if v is not None and v == v and (whole or f"{name}.{f}" in declared):
                        series = known.get((name, ".", f))
                        if series is None:
                            series = known[(name, ".", f)] = windows.series_for(f"{prefix}{name}.{f}")
                        series.append(ts, float(v))
            elif isinstance(value, Labelled):
                total_series = known.get(name)
                if total_series is None:
                    total_series = known[name] = windows.series_for(prefix + name)
                prev_ts = total_series.last_ts
                counter = is_counter(name)
                total = 0.0
                for label, v in value.items():
                    if v is None or v != v:
                        continue
                    series = known.get((name, "{", label))
                    if series is None:
                        key = f"{prefix}{name}{{{label}}}"
                        fresh = windows.series(key) is None
                        series = known[(name, "{", label)] = windows.series_for(key)
                        if counter and prev_ts is not None and fresh:
                            # A label that appears mid-run (the first XID 79, the first CANCEL) counted from 0.
                            series.append(prev_ts, 0.0)
                    series.append(ts, float(v))
                    total += float(v)
                total_series.append(ts, total)
