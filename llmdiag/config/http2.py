"""``[http2]``: the HTTP/2 / gRPC frame collector (eBPF on syscall tracepoints)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Http2Config"]


@dataclass(frozen=True)
class Http2Config:
    #: A send window (stream or connection) that stays exhausted at least this
    #: long before a WINDOW_UPDATE, RST_STREAM or GOAWAY ends it is one flow-control stall.
    stall_seconds: float = 0.2
    #: Connections tracked in the kernel (map size); more are counted as map-full errors.
    max_connections: int = 8192
    #: Open streams tracked for flow-control windows and close detection (LRU map).
    max_streams: int = 32768
    #: Frame-walking steps per walker run and walker runs (tail calls) per syscall:
    #: a frame takes 1-2 steps and each further iovec one, so the defaults walk
    #: ~100-250 frames per read or write (more: the direction re-syncs, counted).
    steps_per_run: int = 8
    max_runs: int = 32
    #: RST_STREAM/GOAWAY events kept in memory for correlation (most recent first out).
    recent_events: int = 1024
    #: Seconds between checks of the backends' listeners; the connection tables are read again
    #: when a listener changed, and every 10 s (each read walks the kernel's whole TCP table).
    refresh_seconds: float = 1.0

    def __post_init__(self) -> None:
        if not 0.001 <= self.stall_seconds <= 60:
            raise ValueError(f"stall_seconds must be in [0.001, 60], got {self.stall_seconds}")
        if not 16 <= self.max_connections <= 1 << 20:
            raise ValueError(f"max_connections must be 16..1048576, got {self.max_connections}")
        if not 64 <= self.max_streams <= 1 << 22:
            raise ValueError(f"max_streams must be 64..4194304, got {self.max_streams}")
        if not 1 <= self.steps_per_run <= 8:
            raise ValueError(f"steps_per_run must be 1..8 (verifier budget), got {self.steps_per_run}")
        if not 1 <= self.max_runs <= 33:
            raise ValueError(f"max_runs must be 1..33 (the kernel's tail-call limit), got {self.max_runs}")
        if not 1 <= self.recent_events <= 1 << 20:
            raise ValueError(f"recent_events must be 1..1048576, got {self.recent_events}")
        if not 0.05 <= self.refresh_seconds <= 3600:
            raise ValueError(f"refresh_seconds must be in [0.05, 3600], got {self.refresh_seconds}")
