"""The demo fleet as snapshots and as a ``llmdiag top`` source (``sim`` sits above ``agent``, so it is wired here)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

from llmdiag.agent.sources import LiveSource
from llmdiag.agent.wiring import build_collectors
from llmdiag.collectors.base import GuardedCollector, collect_snapshot
from llmdiag.config import Config
from llmdiag.model import CollectorStatus, Snapshot
from llmdiag.sim.demo_fleet import DEMO_COLLECTORS, DemoFleet

__all__ = ["demo_snapshots", "demo_source"]


def demo_snapshots(config: Config, fleet: DemoFleet, *, duration: float | None = None,
                   sleep: Callable[[float], None] = time.sleep) -> Iterator[Snapshot]:
    """One snapshot per ``[agent] interval_seconds`` of the running fleet, with the real collectors.

    Ports are reserved and the collectors built before the fleet starts (if it has
    not yet). The HTTP engines go to the engine, proc, tcp and timewait collectors; the gRPC
    ports (``vllm-3-grpc``) to the http2 collector, which is the one that can read
    their frames, and to the engine collector, which scrapes their ``metrics_url``
    (the same engine's HTTP ``/metrics``). Collectors
    are closed when the generator ends or is closed.
    """
    fleet.reserve_ports()
    backends = fleet.backends()
    http = [b for b in backends if b.scheme != "grpc"]
    grpc = [b for b in backends if b.scheme == "grpc"]
    wanted = list(config.agent.collectors or DEMO_COLLECTORS)  # [agent] collectors narrows them
    names = [n for n in wanted if n != "http2"]
    # The engine collector scrapes a gRPC port's metrics_url (vllm-3-grpc reads vllm-3's /metrics);
    # the host collectors (proc, tcp, timewait) watch the HTTP ports only.
    per_list = [(http + [b for b in grpc if b.metrics_url], [n for n in names if n == "engine"]),
                (http, [n for n in names if n != "engine"])]
    if grpc and "http2" in wanted:
        per_list.append((grpc, ["http2"]))
    collectors: list[GuardedCollector] = []
    unavailable: dict[str, CollectorStatus] = {}
    for some_backends, some_names in per_list:
        if not some_names:
            continue
        try:
            more, more_unavailable = build_collectors(config, some_backends, some_names)
        except BaseException:
            for c in collectors:
                c.close()
            raise
        collectors += more
        unavailable.update(more_unavailable)
    if not fleet.started:
        # Collectors first (BPF compiles for seconds), then the fleet: the fault script's clock
        # starts with the engines, so the healthy phase before the faults is all recorded.
        try:
            fleet.start()
        except BaseException:
            for c in collectors:
                c.close()
            raise
    hostname = config.agent.hostname or socket.gethostname()
    interval = config.agent.interval_seconds
    ticks = None if duration is None else max(1, int(round(duration / interval)))
    try:
        next_tick = time.monotonic()
        count = 0
        while ticks is None or count < ticks:
            snap = collect_snapshot(collectors, time.time(), hostname)
            snap.collectors.update(unavailable)
            yield snap
            count += 1
            next_tick += interval
            delay = next_tick - time.monotonic()
            if delay > 0:
                sleep(delay)
    finally:
        for c in collectors:
            c.close()


def demo_source(config: Config, duration: float | None = None, fleet: DemoFleet | None = None) -> LiveSource:
    """Start the demo fleet and watch it with the real collectors; closing the source stops the fleet."""
    fleet = fleet or DemoFleet()
    fleet.reserve_ports()  # the fleet itself starts on the reading thread, once the collectors are built
    return LiveSource(
        config, fleet.backends(),
        lambda sleep: demo_snapshots(config, fleet, duration=duration, sleep=sleep),
        description=f"demo fleet ({fleet.describe()})", on_close=fleet.stop,
    )
