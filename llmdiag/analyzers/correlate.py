"""Join events that happen on the same connection or backend within a time window.

An :class:`Event` is something that happened at a tick on a key: a counter
that rose (a flow-control stall, a RST_STREAM, a burst of client cancels) or
a condition that held (TTFT above its bar). The key is the connection label
when the signal carries one (``conn=...``), else the backend name, so the
join is per connection when the collector can tell connections apart and per
backend otherwise.

:func:`follows` answers "which A events were followed by a B event on the same
key within ``within`` seconds" (``grpc_flow_control_stall``);
:func:`coincide` answers "which A events had a B event on the same key within
``within`` seconds either side" (``client_timeout_storm``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Event", "Match", "coincide", "follows"]


@dataclass(frozen=True, slots=True)
class Event:
    ts: float
    key: str
    what: str
    amount: float = 1.0


@dataclass(frozen=True, slots=True)
class Match:
    first: Event
    second: Event


def _by_key(events: Iterable[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        out[e.key].append(e)
    for lst in out.values():
        lst.sort(key=lambda e: e.ts)
    return out


def _indexed(events: Iterable[Event]) -> tuple[dict[str, list[Event]], dict[str, list[float]]]:
    """Events by key, sorted by time, and their timestamps (for bisect)."""
    by_key = _by_key(events)
    return by_key, {k: [e.ts for e in v] for k, v in by_key.items()}


def follows(first: Iterable[Event], then: Iterable[Event], within: float) -> list[Match]:
    """Each ``first`` event matched with the earliest ``then`` event on its key in ``[ts, ts + within]``."""
    later, stamps = _indexed(then)
    matches = []
    for a in sorted(first, key=lambda e: e.ts):
        lst = later.get(a.key)
        if not lst:
            continue
        i = bisect_left(stamps[a.key], a.ts)
        if i < len(lst) and lst[i].ts - a.ts <= within:
            matches.append(Match(a, lst[i]))
    return matches


def coincide(first: Iterable[Event], other: Iterable[Event], within: float) -> list[Match]:
    """Each ``first`` event matched with the nearest ``other`` event on its key no more than ``within`` away."""
    others, stamps = _indexed(other)
    matches = []
    for a in sorted(first, key=lambda e: e.ts):
        lst = others.get(a.key)
        if not lst:
            continue
        ts = stamps[a.key]
        i = bisect_left(ts, a.ts)
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(lst) and abs(lst[j].ts - a.ts) <= within:
                if best is None or abs(lst[j].ts - a.ts) < abs(best.ts - a.ts):
                    best = lst[j]
        if best is not None:
            matches.append(Match(a, best))
    return matches
