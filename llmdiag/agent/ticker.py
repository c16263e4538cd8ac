"""The tick loop: build the collectors once, then one snapshot every ``[agent] interval_seconds``."""

from __future__ import annotations

import concurrent.futures
import math
import socket
import time
from collections.abc import Callable, Iterator, Sequence

from llmdiag.agent.wiring import BuildProgress, build_collectors
from llmdiag.collectors.base import GuardedCollector, collect_snapshot
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorStatus, Sample, Snapshot

__all__ = ["collect_concurrently", "collector_groups", "snapshot_ticks"]

#: Collectors that read another's state during collect() run after it, in the same thread.
_AFTER = {"timewait": "tcp"}

#: Collectors whose every read the kernel answers at once (/proc files, BPF maps, sock_diag):
#: pure CPU under the GIL, so a thread each only adds hand-offs and GIL switches. They run one
#: after the other in the ticking thread while the others (HTTP scrapes, NVML calls: waits on
#: something outside the process) run in the pool. Any collector not named here gets a thread.
INLINE = frozenset({"proc", "tcp", "timewait", "cuda", "http2"})


def collector_groups(collectors: Sequence[GuardedCollector]) -> list[list[GuardedCollector]]:
    """Independent groups, each run in order in one thread: the timewait collector reads the tcp
    collector's counters, so it runs after it; every other collector is a group of its own."""
    by_name = {c.name: c for c in collectors}
    groups: dict[str, list[GuardedCollector]] = {}
    for c in collectors:
        head = _AFTER.get(c.name)
        key = head if head in by_name else c.name
        groups.setdefault(key, []).append(c)
    for key, group in groups.items():
        group.sort(key=lambda c: c.name != key)  # the one read from goes first
    return list(groups.values())


def collect_concurrently(
    collectors: Sequence[GuardedCollector],
    now: float,
    hostname: str,
    pool: concurrent.futures.Executor,
) -> tuple[Snapshot, dict[str, float]]:
    """One snapshot with the :func:`collector_groups` running side by side (a scrape waiting on
    the network overlaps /proc reads and BPF map reads), folded in the collectors' order so the
    snapshot is the one a sequential tick gives. Returns it and each collector's seconds.

    Groups made only of :data:`INLINE` collectors run in the calling thread, after the others
    were handed to ``pool``."""

    def run(group: Sequence[GuardedCollector]) -> list[tuple[GuardedCollector, list[Sample], CollectorStatus, float]]:
        out = []
        for c in group:
            started = time.perf_counter()
            samples = c.collect(now)  # GuardedCollector: never raises
            out.append((c, samples, c.status(), time.perf_counter() - started))
        return out

    groups = collector_groups(collectors)
    inline = [g for g in groups if all(c.name in INLINE for c in g)]
    futures = [pool.submit(run, g) for g in groups if not all(c.name in INLINE for c in g)]
    done = [item for g in inline for item in run(g)]
    done += [item for f in futures for item in f.result()]
    results = {id(c): (samples, status, took) for c, samples, status, took in done}
    snap = Snapshot(ts=now, hostname=hostname)
    seconds: dict[str, float] = {}
    for c in collectors:
        samples, status, took = results[id(c)]
        snap.extend(samples)
        snap.collectors[c.name] = status
        seconds[c.name] = took
    return snap, seconds


def snapshot_ticks(
    config: Config,
    backends: list[Backend],
    names: list[str] | None = None,
    *,
    duration: float | None = None,
    prime: bool = False,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] | None = None,
    progress: BuildProgress | None = None,
) -> Iterator[Snapshot]:
    """Build the collectors and yield one snapshot every ``[agent] interval_seconds``.

    ``clock`` stamps the snapshots (wall time); ticks are scheduled on ``monotonic``
    (default ``time.monotonic``, or ``clock`` itself when a test injects one) so that a
    wall-clock step (NTP) never stalls or bunches the ticks.

    ``duration`` gives ``max(1, round(duration / interval))`` snapshots (``None``: until the
    consumer stops). ``prime`` runs one unreported tick first, so that rates and window
    quantiles exist in the first snapshot yielded. Collectors are closed when the generator
    ends or is closed (BPF programs detached). Unknown collector names raise ``ValueError``
    before anything is yielded. ``progress`` is passed to :func:`build_collectors`.
    """
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")
    collectors, unavailable = build_collectors(config, backends, names, progress)
    hostname = config.agent.hostname or socket.gethostname()
    interval = config.agent.interval_seconds
    ticks = None if duration is None else max(1, int(round(duration / interval)))
    mono = monotonic or (time.monotonic if clock is time.time else clock)
    try:
        if prime:
            collect_snapshot(collectors, clock(), hostname)
            sleep(interval)
        next_tick = mono()
        count = 0
        while True:
            snap = collect_snapshot(collectors, clock(), hostname)
            snap.collectors.update(unavailable)
            yield snap
            count += 1
            if ticks is not None and count >= ticks:
                return
            next_tick += interval
            delay = next_tick - mono()
            if delay > 0:
                sleep(delay)
    finally:
        for c in collectors:
            c.close()
