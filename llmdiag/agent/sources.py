"""Data sources for ``llmdiag top``: one small interface over live, recorded and remote data.

The TUI never reaches past a :class:`StateSource`. Each call to
:meth:`StateSource.read` blocks until the next :class:`FleetState` (one per
tick) and returns it, or returns ``None`` when the source has ended (end of
a recording, source closed). ``read`` is called from one worker thread;
:meth:`StateSource.close` may be called from any thread and wakes a blocked
``read``. Nothing here imports Textual or rich.

Sources:

- :class:`LiveSource`: the collectors of this host, in-process, fed through
  the same analyzer and scoring balancer the agent runs (:class:`Pipeline`);
  it also serves the demo fleet (the caller passes the fleet's backends and
  a ``stop`` callback, since ``sim`` sits above ``agent``);
- :class:`ReplaySource`: a recording from ``llmdiag collect --record FILE``
  through the same pipeline, paced by the recorded timestamps, with pause,
  single step, speed and "jump to the next diagnosis".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmdiag.analyzers import Analyzer
from llmdiag.config import Config
from llmdiag.model import Backend, BackendState, Diagnosis, Reason, Snapshot, read_snapshots
from llmdiag.router_feedback.balancer import Balancer
from llmdiag.router_feedback.score import ScoreFactors

__all__ = [
    "FleetState",
    "LiveSource",
    "Pipeline",
    "ReplaySource",
    "RoutingView",
    "StateSource",
]

log = logging.getLogger("llmdiag.agent.sources")


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What the scoring balancer makes of one backend at one tick, and why."""

    name: str
    address: str
    state: BackendState
    score: float
    penalty: float
    weight_percent: int
    reasons: tuple[Reason, ...] = ()
    factors: ScoreFactors | None = None


@dataclass(frozen=True, slots=True)
class FleetState:
    """One tick as the TUI shows it: the snapshot, the diagnoses and the routing decision."""

    ts: float
    host: str
    snapshot: Snapshot
    open: tuple[Diagnosis, ...]
    opened: tuple[Diagnosis, ...]
    closed: tuple[Diagnosis, ...]
    routing: dict[str, RoutingView]
    #: kind -> whether its penalty is charged (a kind with ``enforce = false`` is only reported)
    enforced: dict[str, bool] = field(default_factory=dict)

    @property
    def backend_names(self) -> list[str]:
        return sorted(set(self.snapshot.backends) | set(self.routing))

    def open_for(self, backend: str) -> list[Diagnosis]:
        """The backend's open diagnoses, worst first."""
        found = [d for d in self.open if d.backend == backend]
        found.sort(key=lambda d: (-d.severity.rank, -d.penalty, d.kind))
        return found


class StateSource(Protocol):
    """Where ``llmdiag top`` gets its ticks (see the module docstring for the threading contract)."""

    #: One line for the header: "live on gpu-node-7", "replay of run.jsonl" ...
    description: str

    def read(self) -> FleetState | None: ...

    def close(self) -> None: ...


class Pipeline:
    """Analyzer + scoring balancer, stepped by snapshots: what the agent does each tick.

    Time is the snapshot's ``ts`` for both (the balancer's clock is the last
    snapshot's timestamp), so a replay gives the states the live run gave.
    """

    def __init__(self, config: Config, backends: Sequence[Backend] | None = None) -> None:
        self.config = config
        self._now = 0.0
        known = list(backends if backends is not None else config.backend_list())
        self.analyzer = Analyzer(config, backends=known)
        self.balancer = Balancer(known, config.balancer, clock=lambda: self._now)
        self._known = {b.name for b in known}
        self._unaddressed: set[str] = set()
        self.hostname = config.agent.hostname or ""

    def observe(self, snapshot: Snapshot) -> FleetState:
        self._now = snapshot.ts
        for name in snapshot.backends:
            if name not in self._known:
                # A recording (or discovery) names a backend the config did not: route it too.
                self._known.add(name)
                self._unaddressed.add(name)
                self.balancer.add_backend(Backend(name=name, url="http://0.0.0.0:1"))
        result = self.analyzer.observe(snapshot)
        for name, signals in snapshot.backends.items():
            self.balancer.update_signals(name, signals)
        for name, health in result.backends.items():
            if name in self._known:
                self.balancer.set_penalty(name, health.penalty, health.reasons)
        routing = {
            p.name: RoutingView(p.name, "" if p.name in self._unaddressed else p.address, p.state, p.score, p.penalty, p.weight_percent, p.reasons,
                                self.balancer.factors(p.name))
            for p in self.balancer.snapshot_states()
        }
        return FleetState(
            ts=snapshot.ts, host=snapshot.hostname or self.hostname, snapshot=snapshot, open=result.open,
            opened=result.opened, closed=result.closed, routing=routing, enforced=dict(self.analyzer.enforced),
        )


class _Interruptible:
    """A sleep that :meth:`wake` cuts short (so ``close`` never waits out a tick)."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.stopped.wait(max(0.0, seconds))


class LiveSource:
    """This host's collectors (or any snapshot iterator) through a :class:`Pipeline`, one state per tick.

    ``snapshots`` is a factory ``(sleep) -> Iterator[Snapshot]`` (normally
    :func:`llmdiag.agent.wiring.snapshot_ticks` bound to the config and
    backends); it must sleep between ticks with the ``sleep`` it is given,
    which :meth:`close` interrupts. ``on_close`` runs once when the source is
    closed (the demo stops its fleet there).
    """

    def __init__(self, config: Config, backends: Sequence[Backend],
                 snapshots: Callable[[Callable[[float], None]], Iterator[Snapshot]], *,
                 description: str = "live", on_close: Callable[[], None] | None = None) -> None:
        self.description = description
        self.pipeline = Pipeline(config, backends)
        self._sleeper = _Interruptible()
        self._make = snapshots
        self._iter: Iterator[Snapshot] | None = None
        self._on_close = on_close
        self._closed_lock = threading.Lock()
        self._closed = False

    def read(self) -> FleetState | None:
        if self._sleeper.stopped.is_set():
            self._finish()
            return None
        if self._iter is None:
            self._iter = self._make(self._sleeper.sleep)
        try:
            snap = next(self._iter)
        except StopIteration:
            return None
        if self._sleeper.stopped.is_set():
            self._finish()
            return None
        return self.pipeline.observe(snap)

    def _finish(self) -> None:
        # The generator is closed on the thread that runs it (closing it from another thread
        # while it sleeps raises "generator already executing").
        if self._iter is not None:
            close = getattr(self._iter, "close", None)
            if close is not None:
                close()
            self._iter = None

    def close(self) -> None:
        self._sleeper.stopped.set()
        with self._closed_lock:
            if self._closed:
                return
            self._closed = True
        if self._on_close is not None:
            self._on_close()


class ReplaySource:
    """A recording, paced by its own timestamps (``speed`` x real time), with replay controls.

    Controls (any thread): :meth:`pause`, :meth:`resume`, :meth:`toggle_pause`,
    :meth:`step` (one tick while paused), :meth:`set_speed`,
    :meth:`jump_to_next_diagnosis` (run without pauses until a tick opens a
    diagnosis, then pause there). ``sleep`` is injectable for tests.
    """

    MIN_SPEED = 0.25
    MAX_SPEED = 64.0

    def __init__(self, config: Config, snapshots: Iterable[Snapshot], *, description: str = "replay",
                 speed: float = 1.0, paused: bool = False, backends: Sequence[Backend] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.description = description
        self.pipeline = Pipeline(config, backends)  # None: the configured backends (addresses for TIME_WAIT)
        self._snapshots = iter(snapshots)
        self._cond = threading.Condition()
        self._paused = paused
        self._steps = 0
        self._seeking = False
        self._closed = False
        self._speed = self._clamp(speed)
        self._monotonic = monotonic
        self._last_ts: float | None = None
        self._last_at: float | None = None
        self.position = 0  # snapshots delivered

    @classmethod
    def from_file(cls, config: Config, path: str, **kwargs: object) -> ReplaySource:
        """Read the whole recording first, so a bad file fails before the UI starts."""
        snapshots = list(read_snapshots(path))
        kwargs.setdefault("description", f"replay of {os.path.basename(path)}")
        return cls(config, snapshots, **kwargs)  # type: ignore[arg-type]

    # -- controls --------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def speed(self) -> float:
        return self._speed

    def _clamp(self, speed: float) -> float:
        return min(self.MAX_SPEED, max(self.MIN_SPEED, float(speed)))

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._last_at = None  # do not "catch up" the paused time
            self._cond.notify_all()

    def toggle_pause(self) -> bool:
        (self.resume if self._paused else self.pause)()
        return self._paused

    def step(self) -> None:
        with self._cond:
            self._paused = True
            self._steps += 1
            self._cond.notify_all()

    def set_speed(self, speed: float) -> float:
        with self._cond:
            self._speed = self._clamp(speed)
            self._cond.notify_all()
        return self._speed

    def jump_to_next_diagnosis(self) -> None:
        with self._cond:
            self._seeking = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- reading -----------------------------------------------------------------
    def _wait_turn(self, ts: float) -> bool:
        """Block until ``ts`` is due (paced, paused, stepping or seeking); False when closed."""
        with self._cond:
            while True:
                if self._closed:
                    return False
                if self._seeking:
                    return True
                if self._paused:
                    if self._steps > 0:
                        self._steps -= 1
                        return True
                    self._cond.wait()
                    continue
                if self._last_ts is None or self._last_at is None:
                    return True
                due = self._last_at + max(0.0, ts - self._last_ts) / self._speed
                left = due - self._monotonic()
                if left <= 0:
                    return True
                self._cond.wait(timeout=min(left, 0.5))

    def read(self) -> FleetState | None:
        try:
            snap = next(self._snapshots)
        except StopIteration:
            return None
        if not self._wait_turn(snap.ts):
            return None
        state = self.pipeline.observe(snap)
        self.position += 1
        with self._cond:
            self._last_ts = snap.ts
            self._last_at = self._monotonic()
            if self._seeking and state.opened:
                # Seeking runs unpaced (every tick still shown, so sparklines stay whole)
                # and stops on the tick that opened a diagnosis.
                self._seeking = False
                self._paused = True
        return state
