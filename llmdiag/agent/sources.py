"""Data sources for ``llmdiag top``: one small interface over live, recorded and remote agent data.

The TUI never reaches past a :class:`StateSource`. Each call to
:meth:`StateSource.read` blocks until the next tick and returns its
:class:`~llmdiag.agent.loop.AgentState` (what ``GET /v1/state`` serves), or
returns ``None`` when the source has ended (end of a recording, source
closed). ``read`` is called from one worker thread; :meth:`StateSource.close`
may be called from any thread and wakes a blocked ``read``. Nothing here
imports Textual or rich.

Sources:

- :class:`LiveSource`: snapshots from this host's collectors (or any snapshot
  factory) through an :class:`~llmdiag.agent.loop.AgentLoop`, the agent's own
  tick work; it also serves the demo fleet (the caller passes the fleet's
  snapshots and a ``stop`` callback, since ``sim`` sits above ``agent``);
- :class:`ReplaySource`: a recording from ``llmdiag collect --record FILE``
  through an ``AgentLoop``, paced by the recorded timestamps, with pause,
  single step, speed and "jump to the next diagnosis";
- :class:`AgentSource`: a running agent's ``GET /v1/state``, polled once per
  interval.

:func:`diagnosis_changes` tells which diagnoses opened and closed between two
states, whatever the source (a remote agent only sends states).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from llmdiag.agent.loop import AgentLoop, AgentState
from llmdiag.config import Config
from llmdiag.model import Backend, Diagnosis, Snapshot, read_snapshots

__all__ = [
    "AgentSource",
    "LiveSource",
    "ReplaySource",
    "StateSource",
    "diagnosis_changes",
]

log = logging.getLogger("llmdiag.agent.sources")


class StateSource(Protocol):
    """Where ``llmdiag top`` gets its ticks (see the module docstring for the threading contract)."""

    #: One line for the header: "live on this host (vllm-0, vllm-1)", "replay of run.jsonl" ...
    description: str

    def read(self) -> AgentState | None: ...

    def close(self) -> None: ...


def _key(d: Diagnosis) -> tuple[str, str, float]:
    return (d.kind, d.backend, d.since)


def diagnosis_changes(previous: AgentState | None, current: AgentState) -> tuple[list[Diagnosis], list[Diagnosis]]:
    """(opened, closed) between two consecutive states: by identity (kind, backend, since)."""
    before = {_key(d): d for d in previous.open} if previous is not None else {}
    now = {_key(d): d for d in current.open}
    opened = [d for k, d in now.items() if k not in before]
    closed = [d for k, d in before.items() if k not in now]
    return opened, closed


class _Interruptible:
    """A sleep that :meth:`LiveSource.close` cuts short (so quitting never waits out a tick)."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.stopped.wait(max(0.0, seconds))


class LiveSource:
    """Snapshots from ``snapshots(sleep)`` through an :class:`AgentLoop`, one state per tick.

    ``snapshots`` is a factory ``(sleep) -> Iterator[Snapshot]`` (normally
    :func:`llmdiag.agent.ticker.snapshot_ticks` bound to the config and backends);
    it must sleep between ticks with the ``sleep`` it is given, which :meth:`close`
    interrupts. It is called, and the iterator closed, on the reading thread.
    ``on_close`` runs once when the source is closed (the demo stops its fleet there).
    """

    def __init__(self, config: Config, backends: Sequence[Backend],
                 snapshots: Callable[[Callable[[float], None]], Iterator[Snapshot]], *,
                 description: str = "live", on_close: Callable[[], None] | None = None) -> None:
        self.description = description
        self.loop = AgentLoop(config, backends)
        self._sleeper = _Interruptible()
        self._make = snapshots
        self._iter: Iterator[Snapshot] | None = None
        self._on_close = on_close
        self._close_lock = threading.Lock()
        self._closed = False

    def read(self) -> AgentState | None:
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
        return self.loop.observe(snap)

    def _finish(self) -> None:
        # Closed on the thread that runs it: closing a generator from another thread while
        # it sleeps raises "generator already executing". Closing it closes the collectors.
        if self._iter is not None:
            close = getattr(self._iter, "close", None)
            if close is not None:
                close()
            self._iter = None

    def close(self) -> None:
        self._sleeper.stopped.set()
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._on_close is not None:
            self._on_close()


class ReplaySource:
    """A recording, paced by its own timestamps (``speed`` x real time), with replay controls.

    Controls (any thread): :meth:`pause`, :meth:`resume`, :meth:`toggle_pause`,
    :meth:`step` (one tick while paused), :meth:`set_speed`,
    :meth:`jump_to_next_diagnosis` (run unpaced until a tick opens a diagnosis,
    then pause there; every tick on the way is still delivered, so histories
    stay whole). ``backends`` (default: the configured ones) give addresses,
    so TIME_WAIT towards ``ip:port`` is its backend's. ``monotonic`` is
    injectable for tests.
    """

    MIN_SPEED = 0.25
    MAX_SPEED = 64.0

    def __init__(self, config: Config, snapshots: Iterable[Snapshot], *, description: str = "replay",
                 speed: float = 1.0, paused: bool = False, backends: Sequence[Backend] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.description = description
        self.loop = AgentLoop(config, backends if backends is not None else config.backend_list())
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
        self._previous: AgentState | None = None
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
            self._last_at = None  # play on from here; do not "catch up" the paused time
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

    def read(self) -> AgentState | None:
        try:
            snap = next(self._snapshots)
        except StopIteration:
            return None
        if not self._wait_turn(snap.ts):
            return None
        state = self.loop.observe(snap)
        opened, _ = diagnosis_changes(self._previous, state)
        self._previous = state
        self.position += 1
        with self._cond:
            self._last_ts = snap.ts
            self._last_at = self._monotonic()
            if self._seeking and opened:
                self._seeking = False
                self._paused = True
        return state


class AgentSource:
    """A running agent's ``GET /v1/state``, polled every ``interval`` seconds.

    An unreachable or broken agent is not the end: ``read`` keeps trying (every
    ``interval``) until it gets a new state or the source is closed, and
    :attr:`error` says what went wrong last (``None`` once it answers again).
    A state with the same ``ts`` as the last one is not delivered twice.
    """

    def __init__(self, url: str, *, interval: float = 1.0, timeout: float = 2.0, token: str | None = None,
                 opener: Callable[..., object] | None = None) -> None:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"agent URL must be http(s)://host:port, got {url!r}")
        self.url = base if base.endswith("/v1/state") else f"{base}/v1/state"
        self.description = f"agent at {base}"
        self.interval = interval
        self.timeout = timeout
        self.token = token
        self.error: str | None = None
        self._open = opener or urllib.request.urlopen
        self._stopped = threading.Event()
        self._last_ts: float | None = None

    def fetch(self) -> AgentState:
        """One ``GET /v1/state`` (raises ``OSError`` or ``ValueError`` with the reason)."""
        request = urllib.request.Request(self.url, headers={"Accept": "application/json"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._open(request, timeout=self.timeout) as response:  # type: ignore[attr-defined]
                body = response.read(64 << 20)
        except urllib.error.HTTPError as exc:
            raise OSError(f"HTTP {exc.code} from {self.url}") from None
        try:
            return AgentState.from_json(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.url} did not answer JSON: {exc}") from None

    def read(self) -> AgentState | None:
        while not self._stopped.is_set():
            try:
                state = self.fetch()
            except (OSError, ValueError) as exc:
                self.error = str(getattr(exc, "reason", None) or exc)
                self._stopped.wait(self.interval)
                continue
            self.error = None
            if self._last_ts is not None and state.ts <= self._last_ts:
                self._stopped.wait(self.interval / 4)
                continue
            self._last_ts = state.ts
            return state
        return None

    def close(self) -> None:
        self._stopped.set()
