"""Passive health: a per-backend circuit breaker (SPEC 6.3, seed 002).

::

    closed --(consecutive_failures failures in a row, or eject())--> open (ejected) for
        min(ejection_max, ejection_base * 2 ** (ejections - 1)) seconds
    open --(probe_successes probe successes in a row, or the ejection time over)--> half_open
    half_open --(half_open_successes successes in a row)--> closed
    half_open --(any failure)--> open again, with the next (longer) ejection time

Re-admission after a crash (issue 14): a refused connection (the process is
gone) is the strongest evidence there is, and so is its end. When a refused
connection was seen since the circuit last closed, **one** good probe goes
half-open, unless the backend is flapping (ejected more than once within
``ejection_max_seconds``: then ``probe_successes`` in a row, as for any
other fault). And while the latest probe failed, the ejection timer does not
send a trial request to a backend known to be down: the circuit stays open,
re-checked every ``probe_ejected_interval_seconds``, so a refused trial cannot
re-open it for a doubled time. Without probes the timer works as before.

A backend that stayed closed for ``ejection_max_seconds`` forgets its past
ejections, so the backoff starts over. Passive results that arrive while the
circuit is open (requests dispatched before the ejection) do not move it:
only probes and the timer do.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from llmdiag.config.balancer import BalancerConfig

__all__ = ["Breaker", "BreakerState"]


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class Breaker:
    """Mutable state machine; the balancer drives it under its writer lock.

    Every method returns ``True`` when the state changed (the routing table
    must then be rebuilt).
    """

    cfg: BalancerConfig
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0
    open_until: float = 0.0
    closed_since: float = 0.0
    #: A refused connection (or a ``backend_down`` report) was seen since the circuit last closed.
    refused: bool = False
    #: When the latest probe while open failed (-inf: none failed since the circuit opened).
    probe_failed_at: float = -math.inf

    def on_success(self, now: float) -> bool:
        if self.state is BreakerState.OPEN:
            return self.tick(now)
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.consecutive_successes += 1
            if self.consecutive_successes >= self.cfg.half_open_successes:
                self._close(now)
                return True
        return False

    def on_failure(self, now: float) -> bool:
        if self.state is BreakerState.OPEN:
            return self.tick(now)
        self.consecutive_successes = 0
        if self.state is BreakerState.HALF_OPEN:
            self._open(now)
            return True
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.cfg.consecutive_failures:
            self._open(now)
            return True
        return False

    def on_probe(self, ok: bool, now: float, refused: bool = False) -> bool:
        """An active probe result; ``refused``: the connection was refused (the process is not there).

        While open, ``probe_successes`` good probes in a row go half-open at
        once; one is enough after a refused connection unless the backend flaps.
        """
        if refused:
            self.refused = True
        if self.state is not BreakerState.OPEN:
            return self.on_success(now) if ok else self.on_failure(now)
        if not ok:
            self.consecutive_successes = 0
            self.probe_failed_at = now
            return self.tick(now)
        self.probe_failed_at = -math.inf
        self.consecutive_successes += 1
        if self.consecutive_successes >= self.probes_needed():
            self._half_open()
            return True
        return self.tick(now)

    def probes_needed(self) -> int:
        """Good probes in a row that take an open circuit to half-open now."""
        if self.refused and self.ejections <= 1:
            return 1
        return self.cfg.probe_successes

    def on_refused(self) -> None:
        """A connection to the backend was refused: its process is gone (evidence for re-admission)."""
        self.refused = True

    def eject(self, now: float) -> bool:
        """Open the circuit now (a ``backend_down`` report); True when it was not open."""
        self.refused = True
        if self.state is BreakerState.OPEN:
            return False
        self._open(now)
        return True

    def tick(self, now: float) -> bool:
        """Move an open circuit whose ejection time is over to half-open.

        Not while the latest probe failed (recently): the backend is known to
        be down, so the circuit stays open and is looked at again one probe
        interval later.
        """
        if self.state is BreakerState.OPEN and now >= self.open_until:
            recheck = self.cfg.probe_ejected_interval_seconds
            if now - self.probe_failed_at <= 2.0 * recheck:
                self.open_until = now + recheck
                return False
            self._half_open()
            return True
        return False

    def ejection_seconds(self) -> float:
        """Length of the current (or last) ejection."""
        n = max(1, self.ejections)
        return min(self.cfg.ejection_max_seconds, self.cfg.ejection_base_seconds * 2.0 ** min(n - 1, 30))

    def _open(self, now: float) -> None:
        if self.state is BreakerState.CLOSED and self.ejections and now - self.closed_since >= self.cfg.ejection_max_seconds:
            self.ejections = 0  # healthy long enough: the backoff starts over
        self.ejections += 1
        self.state = BreakerState.OPEN
        self.open_until = now + self.ejection_seconds()
        self.probe_failed_at = -math.inf
        self.consecutive_failures = 0
        self.consecutive_successes = 0

    def _half_open(self) -> None:
        self.state = BreakerState.HALF_OPEN
        self.consecutive_successes = 0
        self.consecutive_failures = 0

    def _close(self, now: float) -> None:
        self.state = BreakerState.CLOSED
        self.closed_since = now
        self.refused = False
        self.consecutive_successes = 0
        self.consecutive_failures = 0
