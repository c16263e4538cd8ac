"""What a rule sees in one tick: the snapshot, the windows, the baselines, and helpers.

Rules read *current* values from the snapshot (absent = ``None``, never a
made-up zero) and *history* (rates, increases, "value 10 s ago") from the
rolling windows, whose series keys are built by :func:`series_key`:
``b/<backend>/<signal>``, ``e/<backend>/<engine>/<signal>``, ``g/<gpu>/<signal>``,
``d/<ip:port>/<signal>``, ``h//<signal>``. A distribution is recorded as
``<signal>.p50|.p99|.ewma``, a labelled signal as ``<signal>{<labels>}`` per
label string plus ``<signal>`` for the sum. Only what some enabled rule declares in
``Rule.history`` is recorded, and a rule's read of anything its own ``history`` does not
declare raises :class:`UndeclaredHistory`.

Which GPUs serve a backend (:meth:`Context.gpus_for`): ``Backend.gpus`` when
config or discovery filled it (an override), else the GPUs last named in the
backend-scope ``process_memory_bytes{gpu,pid}`` that the gpu collector emits
for backends whose processes hold GPU memory (the analyzer remembers them, so a
lost GPU stays attributed), else every GPU when the snapshot has a single backend. A backend's destination (:meth:`Context.destination_of`)
is :func:`llmdiag.collectors.timewait.backend_destination`, the key the
timewait and tcp collectors file its ``host.destinations`` signals under.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from llmdiag.analyzers.baseline import Baselines
from llmdiag.analyzers.windows import Series, WindowStore, series_key
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import HOST, Distribution, Labelled, Snapshot, parse_label_key

__all__ = ["Context", "UndeclaredHistory", "gpus_from_processes", "history_name", "number"]


#: The signal map of a subject the snapshot lacks (read only: one shared object, not a new dict a read).
_NONE: Mapping[str, Any] = {}


class UndeclaredHistory(LookupError):
    """A rule read the history of a signal its ``Rule.history`` does not declare: unless another
    rule declares it, the analyzer does not record it and the read would see nothing. A bug in
    the rule, raised under :data:`STRICT_HISTORY` so that any test reaching the read fails."""


#: Raise :class:`UndeclaredHistory` on an undeclared read (``LLMDIAG_STRICT_HISTORY=1``, which the
#: test suite sets). Otherwise, as in a running agent, the read is noted in ``Context.undeclared``
#: and the analyzer logs the bug once and records that history from then on: a rule path no test
#: reached costs one tick of missing history, never a tick that fails every second.
STRICT_HISTORY = os.environ.get("LLMDIAG_STRICT_HISTORY") == "1"


def history_name(signal: str) -> str:
    """The family of a window signal: ``ttft_seconds.ewma`` -> ``ttft_seconds``,
    ``responses_total{class=ok}`` -> ``responses_total`` (declaring it declares them all)."""
    return signal.partition("{")[0].partition(".")[0]


def number(value: Any) -> float | None:
    """A plain finite number, else ``None`` (NA, absent, labelled, distribution)."""
    if type(value) is float:  # the common case, a few hundred calls a tick: x - x is 0.0 iff x is finite
        return value if value - value == 0.0 else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def gpus_from_processes(signals: Mapping[str, Any]) -> tuple[str, ...]:
    """GPU indices named by a backend's ``process_memory_bytes`` (``{"gpu=0,pid=4101": bytes}``,
    the gpu collector's per-backend attribution), sorted numerically; ``()`` without it."""
    value = signals.get("process_memory_bytes")
    if not isinstance(value, Labelled):
        return ()
    gpus = set()
    for key in value:
        try:
            gpu = parse_label_key(key).get("gpu")
        except ValueError:
            continue
        if gpu:
            gpus.add(gpu)
    return tuple(sorted(gpus, key=lambda g: (len(g), g)))


class Context:
    def __init__(
        self,
        snapshot: Snapshot,
        windows: WindowStore,
        baselines: Baselines,
        config: DiagnosisConfig,
        gpus_by_backend: Mapping[str, tuple[str, ...]],
        destination_of: Mapping[str, str],
        history: frozenset[str] | None = None,
    ) -> None:
        """``history``: the ``scope/signal`` entries whose history may be read (``None``: any;
        ``Rule.history``); a read of another one raises :class:`UndeclaredHistory`. The analyzer sets it to each rule's own
        ``Rule.history`` while that rule runs, so a rule that reads an undeclared signal fails
        even when another rule happens to declare (and so record) it."""
        self.snapshot = snapshot
        self.history = history
        self.now = snapshot.ts
        self.windows = windows
        self.baselines = baselines
        self.config = config
        self._gpus_by_backend = gpus_by_backend
        self._destination_of = destination_of
        self._backend_by_destination = {d: b for b, d in destination_of.items()}
        self._baseline_cache: dict[str, float | None] = {}
        self._owners: dict[str, str] | None = None
        self._backends: list[str] | None = None
        self._engine_items: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
        #: (subject, key, value) updates applied after the tick unless the subject is frozen.
        self.baseline_updates: list[tuple[str, str, float]] = []
        #: ``scope/family`` history read without being declared (only when not :data:`STRICT_HISTORY`).
        self.undeclared: set[str] = set()

    # -- subjects ----------------------------------------------------------
    @property
    def backends(self) -> list[str]:
        """The snapshot's backend names, sorted (once per tick: every rule asks)."""
        if self._backends is None:
            self._backends = sorted(self.snapshot.backends)
        return list(self._backends)

    def gpus_for(self, backend: str) -> tuple[str, ...]:
        """The GPU indices serving ``backend``: ``Backend.gpus`` (override), else the GPUs its
        processes held memory on (gpu collector, last seen), else every GPU when the snapshot
        has exactly one backend; else none known."""
        known = self._gpus_by_backend.get(backend)
        if known:
            return tuple(g for g in known if g in self.snapshot.gpus)
        if len(self.snapshot.backends) == 1:
            return tuple(sorted(self.snapshot.gpus))
        return ()

    def owner_of_gpu(self, gpu: str) -> str:
        """The backend a GPU serves, or ``host`` when no single backend can be named."""
        if self._owners is None:
            # Built once per tick: GPU -> backends claiming it (O(backends), not O(backends x GPUs)).
            claims: dict[str, list[str]] = {}
            for b in self.backends:
                for g in self.gpus_for(b):
                    claims.setdefault(g, []).append(b)
            self._owners = {g: bs[0] for g, bs in claims.items() if len(bs) == 1}
        return self._owners.get(gpu, HOST)

    def backend_at(self, destination: str) -> str | None:
        """The backend whose ``ip:port`` destination key is ``destination``, if any."""
        return self._backend_by_destination.get(destination)

    def destination_of(self, backend: str) -> str | None:
        """``backend``'s key in ``snapshot.destinations`` (``None`` for a backend not configured)."""
        return self._destination_of.get(backend)

    def destination(self, destination: str, signal: str) -> float | None:
        return number(self.snapshot.destinations.get(destination, _NONE).get(signal))

    # -- current values ----------------------------------------------------
    def backend(self, backend: str, signal: str) -> float | None:
        return number(self.snapshot.backends.get(backend, _NONE).get(signal))

    def engines(self, backend: str, signal: str) -> Iterator[tuple[str, float]]:
        items = self._engine_items.get(backend)
        if items is None:
            # Sorted once per backend per tick: several rules ask for several signals each.
            items = self._engine_items[backend] = sorted(self.snapshot.engines.get(backend, _NONE).items())
        for label, signals in items:
            v = number(signals.get(signal))
            if v is not None:
                yield label, v

    def worst(self, backend: str, signal: str) -> tuple[str, float] | None:
        """The highest value of a saturation signal over the backend and each DP engine,
        with its evidence name: one overloaded engine must not hide behind a healthy average."""
        best: tuple[str, float] | None = None
        v = self.backend(backend, signal)
        if v is not None:
            best = (signal, v)
        for label, ev in self.engines(backend, signal):
            if best is None or ev > best[1]:
                best = (f"engines[{label}].{signal}", ev)
        return best

    def dist(self, backend: str, signal: str, field: str = "ewma") -> float | None:
        value = self.snapshot.backends.get(backend, _NONE).get(signal)
        if isinstance(value, Distribution):
            return number(getattr(value, field))
        return number(value)

    def labelled(self, signals: Mapping[str, Any], signal: str) -> dict[str, dict[str, str]]:
        """Label strings of a labelled signal -> parsed labels."""
        value = signals.get(signal)
        if not isinstance(value, Labelled):
            return {}
        out = {}
        for key in value:
            try:
                out[key] = parse_label_key(key)
            except ValueError:
                continue
        return out

    def gpu(self, gpu: str, signal: str) -> float | None:
        return number(self.snapshot.gpus.get(gpu, _NONE).get(signal))

    def host(self, signal: str) -> float | None:
        return number(self.snapshot.host.get(signal))

    def up(self, backend: str) -> bool | None:
        """``True`` when the engine answered its last scrape, ``False`` when not, ``None`` unknown."""
        v = self.backend(backend, "up")
        return None if v is None else v >= 1

    # -- history -----------------------------------------------------------
    def outage(self, backend: str) -> tuple[float | None, float | None, float | None]:
        """``(down_since, last_up, last_down)`` from the backend's ``up`` history: when the
        current run of failed scrapes began (``None`` while the last scrape answered), when a
        scrape last answered and when one last failed (``None``: not within the window)."""
        series = self.series("b", backend, "up")
        if series is None or not len(series):
            return None, None, None
        ts, values = series.ts, series.values
        # The common cases in one C-speed pass over the window: never down, or never up in it.
        window = values[series.start:]
        if min(window) >= 1:
            return None, ts[-1], None
        if max(window) < 1:
            return ts[series.start], None, ts[-1]
        down_since = last_up = last_down = None
        for i in range(len(ts) - 1, series.start - 1, -1):
            if values[i] >= 1:
                if last_up is None:
                    last_up = ts[i]
                if last_down is not None:
                    break
            else:
                if last_down is None:
                    last_down = ts[i]
                if last_up is not None:
                    break
                down_since = ts[i]
        return down_since, last_up, last_down

    def _key(self, scope: str, subject: str, signal: str) -> str:
        """The series key of a history read, after checking the signal is recorded."""
        history = self.history
        if history is not None and scope + "/" + signal not in history and f"{scope}/{history_name(signal)}" not in history:
            if not STRICT_HISTORY:
                self.undeclared.add(f"{scope}/{history_name(signal)}")
                return series_key(scope, subject, signal)
            raise UndeclaredHistory(
                f"a rule read the history of {signal!r} at scope {scope!r}, which its Rule.history does not "
                f"declare (so the analyzer may not record it): add reads({scope!r}, {history_name(signal)!r}) to it")
        return series_key(scope, subject, signal)

    def series(self, scope: str, subject: str, signal: str) -> Series | None:
        """The signal's window (``None`` when nothing is recorded); read it, never append."""
        return self.windows.series(self._key(scope, subject, signal))

    def increments(self, scope: str, subject: str, signal: str, seconds: float) -> list[tuple[float, float]]:
        """:meth:`WindowStore.increments` of the signal."""
        return self.windows.increments(self._key(scope, subject, signal), seconds)

    def value_at(self, scope: str, subject: str, signal: str, ts: float) -> float | None:
        """A signal's recorded value at ``ts`` (the last point at or before it)."""
        series = self.windows.series(self._key(scope, subject, signal))
        return None if series is None else series.at(ts)

    def rate(self, scope: str, subject: str, signal: str, seconds: float) -> float | None:
        return self.windows.rate(self._key(scope, subject, signal), seconds)

    def increase(self, scope: str, subject: str, signal: str, seconds: float) -> float | None:
        return self.windows.increase(self._key(scope, subject, signal), seconds)

    def ago(self, scope: str, subject: str, signal: str, seconds: float) -> float | None:
        return self.windows.value_ago(self._key(scope, subject, signal), seconds)

    # -- baselines -----------------------------------------------------------
    def baseline(self, subject: str, name: str, value: float | None) -> float | None:
        """The subject's baseline of ``name`` *before* this tick; queues ``value`` to be
        folded in after the tick unless a diagnosis on ``subject`` is open or pending."""
        key = f"{subject}/{name}"
        if key in self._baseline_cache:
            return self._baseline_cache[key]
        base = self.baselines.get(key)
        self._baseline_cache[key] = base
        if value is not None and math.isfinite(value):
            self.baseline_updates.append((subject, key, value))
        return base

    def ttft(self, backend: str) -> tuple[float | None, float | None]:
        """(TTFT EWMA now, its baseline)."""
        ttft = self.dist(backend, "ttft_seconds", "ewma")
        return ttft, self.baseline(backend, "ttft_ewma", ttft)

    def peers_median(self, backend: str, values: Mapping[str, float]) -> float | None:
        others = [v for b, v in values.items() if b != backend]
        return statistics.median(others) if others else None
