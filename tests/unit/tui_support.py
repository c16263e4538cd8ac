"""A fixed recording for the TUI tests: four backends, three of them going wrong in different ways.

Built with the analyzers' :class:`~llmdiag.analyzers.timelines.TimelineBuilder`
(fixed start time 2026-01-01T00:00:00Z, one snapshot per second), so every run,
every machine and every SVG snapshot sees the same ticks:

- ``vllm-0``: healthy throughout;
- ``vllm-1``: KV cache full with preemptions and a queue from t=40 s
  (``kv_cache_saturation``);
- ``vllm-2``: TTFT 6 s and clients cancelling 9/s from t=48 s (``client_timeout_storm``);
- ``vllm-3``: healthy, but 20k sockets in TIME_WAIT towards it from t=52 s
  (``timewait_exhaustion``, the clients on this host do not pool).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmdiag.analyzers.timelines import TimelineBuilder, dist
from llmdiag.model import Snapshot, write_snapshots

BACKENDS = ("vllm-0", "vllm-1", "vllm-2", "vllm-3")


def fleet_timeline() -> list[Snapshot]:
    t = TimelineBuilder(BACKENDS).advance(40)
    t.backend("vllm-1").set(kv_cache_usage=0.97, requests_waiting=6.0).rate("preemptions_total", 0.5)
    t.advance(8)
    b = t.backend("vllm-2").set(ttft_seconds=dist(6.0))
    b.rate("h2_rst_stream_total", 6.0, code="CANCEL", direction="received").rate("tcp_peer_closes_total", 3.0)
    t.advance(4)
    t.destination("127.0.0.1:8003").set(timewait_sockets=20000.0, ephemeral_ports_available=8000.0,
                                          port_exhaustion_eta_seconds=20.0, timewait_entry_rate=400.0)
    t.host.set(sockstat_tcp_tw=20040.0)
    t.advance(14)
    return t.snapshots


def write_fleet_recording(path: Path) -> Path:
    write_snapshots(path, fleet_timeline())
    return path


def fleet_backends():
    """The recording's backends with their loopback addresses (so TIME_WAIT to 127.0.0.1:8003 is vllm-3's)."""
    return TimelineBuilder(BACKENDS).backends()


class SteppingClock:
    """A monotonic clock that jumps ``step`` seconds per call: a replay at any speed never waits."""

    def __init__(self, step: float = 1000.0) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def until(pilot: Any, check: Any, tries: int = 1500) -> None:
    """Let the app run until ``check()`` holds: up to 30 s on a loaded machine, then fail."""
    for _ in range(tries):
        if check():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")
