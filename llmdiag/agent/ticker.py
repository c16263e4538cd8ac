"""The tick loop: build the collectors once, then one snapshot every ``[agent] interval_seconds``."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Iterator

from llmdiag.agent.wiring import BuildProgress, build_collectors
from llmdiag.collectors.base import collect_snapshot
from llmdiag.config import Config
from llmdiag.model import Backend, Snapshot

__all__ = ["snapshot_ticks"]


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
